"""NameTemplate: the one parser of lock name templates (locked, locked_task, fence_name)."""

from __future__ import annotations

import inspect
import re

import pytest

from distlock.fencing import parse_fence_name
from distlock.names import NameTemplate


def test_fields_and_parts_are_parsed_once():
    template = NameTemplate("report:{customer.id}:{kind!s}:{day:%Y}:{{x}}")
    assert template.fields == {"customer", "kind", "day"}
    assert template.parts == (
        ("report:", "customer.id"), (":", "kind"), (":", "day"), (":{", None), ("x}", None),
    )
    assert NameTemplate("static").fields == frozenset()
    assert repr(NameTemplate("a:{b}")) == "NameTemplate('a:{b}')"


def test_names_are_formatted_from_a_call_with_defaults_filled_in():
    def report(customer_id: int, kind: str = "daily", *, lease: object = None) -> None:
        pass

    template = NameTemplate("report:{customer_id}:{kind}")
    signature = inspect.signature(report)
    template.check_parameters(signature.parameters, "report")
    assert template.format_call(signature, (7,), {}) == "report:7:daily"
    assert template.format_call(signature, (), {"customer_id": 8, "kind": "x"}) == "report:8:x"
    assert template.format({"customer_id": 1, "kind": "k"}) == "report:1:k"
    with pytest.raises(TypeError):
        template.format_call(signature, (), {})  # a missing argument, as the call would


def test_a_field_that_is_not_a_parameter_is_refused_by_name():
    template = NameTemplate("x:{customer}:{day}")
    with pytest.raises(ValueError, match=r"uses \['customer', 'day'\], which f\(\) has no"):
        template.check_parameters(["customer_id"], "f")
    template.check_parameters(["customer", "day", "other"], "f")


@pytest.mark.parametrize(
    ("template", "error", "match"),
    [
        (5, TypeError, "lock name template must be a str, not int"),
        (None, TypeError, "must be a str"),
        ("", ValueError, "must not be empty"),
        ("x:{}", ValueError, r"fields must be named, e\.g\. \{customer_id\}"),
        ("x:{.a}", ValueError, "fields must be named"),
        ("x:{[0]}", ValueError, "fields must be named"),
        ("x:{", ValueError, "Single '{'"),
        ("x:}", ValueError, "Single '}'"),
    ],
)
def test_bad_templates(template, error, match):
    with pytest.raises(error, match=match):
        NameTemplate(template)


def test_messages_name_what_the_template_is_for():
    with pytest.raises(ValueError, match=r"e\.g\. \{invoice_id\}"):
        NameTemplate("x:{}", example="invoice_id")
    with pytest.raises(TypeError, match="fence_name must be a str"):
        NameTemplate(1, what="fence_name")


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("x:{pk:05d}", "must not have a format spec or conversion"),
        ("x:{pk!r}", "must not have a format spec or conversion"),
        ("x:{0}", r"field \{0\} must be a field name such as \{pk\}"),
        ("x:{}", r"field \{\} must be a field name"),
        ("x:{a.b}", "no positions, indexes or attributes"),
        ("x:{a[0]}", "no positions, indexes or attributes"),
    ],
)
def test_plain_mode_allows_only_bare_names(template, match):
    with pytest.raises(ValueError, match=match):
        NameTemplate(template, plain=True, what="fence_name")
    with pytest.raises(ValueError, match="^" + re.escape(f"fence_name {template!r}: field")):
        parse_fence_name(template)


def test_plain_mode_parts_are_what_fence_names_use():
    template = NameTemplate("sheet:{a}:{b}{{c}}", plain=True)
    assert template.parts == (("sheet:", "a"), (":", "b"), ("{", None), ("c}", None))
    assert parse_fence_name("sheet:{a}:{b}{{c}}") == list(template.parts)
    for bad in ("", None, 3):
        with pytest.raises(ValueError, match="fence_name must be a non-empty str"):
            parse_fence_name(bad)


def test_locked_and_locked_task_refuse_the_same_bad_templates_at_decoration():
    from distlock import locked
    from distlock.integrations.celery import locked_task

    for decorator in (locked, locked_task):
        with pytest.raises(ValueError, match="must not be empty"):
            decorator("")
        with pytest.raises(ValueError, match="fields must be named"):
            decorator("x:{}")
        with pytest.raises(ValueError, match=r"uses \['day'\], which .*report\(\) has no"):

            @decorator("x:{day}")
            def report(self, customer_id):
                pass
