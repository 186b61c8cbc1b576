"""Lock names of fenced rows: the ``fence_name`` template, in Python and in SQL.

A FencedModel names the lock guarding each row with ``fence_name``, a ``str.format``
template over its fields (``"account:{pk}"``). Python formats it for one instance; the
conditional writes need the same name for every row in SQL. This module keeps the two
equal: it accepts only templates with a faithful SQL form, formats values as their
columns store them, and builds the SQL expression.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

from django.core.exceptions import FieldDoesNotExist
from django.db import models
from django.db.models import F, Q, Value
from django.db.models.constants import LOOKUP_SEP
from django.db.models.expressions import RawSQL
from django.db.models.functions import Cast, Concat

from distlock.names import NameTemplate

# Column types whose SQL text form equals Python's str() of the value, so a lock name
# built in SQL matches the one built by str.format.
INTEGER_TYPES = {
    "AutoField", "BigAutoField", "SmallAutoField", "IntegerField", "BigIntegerField",
    "SmallIntegerField", "PositiveIntegerField", "PositiveBigIntegerField",
    "PositiveSmallIntegerField",
}
TEXT_TYPES = {"CharField", "TextField", "SlugField"}
_DECIMAL = re.compile(r"-?[0-9]+")

#: :func:`inversion`: no row can be guarded by that lock name.
NO_ROW = object()

C = TypeVar("C", bound=Callable[..., Any])


def parse_fence_name(template: object) -> list[tuple[str, str | None]]:
    """Split a ``fence_name`` template into (literal text, field name or None) pairs.

    Only plain named fields are allowed (``{pk}``, ``{customer_id}``): a format spec,
    conversion, index or attribute has no faithful SQL equivalent. Raises ValueError.
    """
    if not isinstance(template, str) or not template:
        raise ValueError(f"fence_name must be a non-empty str, not {template!r}")
    return list(NameTemplate(template, plain=True, what="fence_name").parts)


def field_names(template: str) -> list[str]:
    """The field names of a valid template, in order (repeats kept)."""
    return [name for _, name in parse_fence_name(template) if name is not None]


def resolve(model: type[models.Model], name: str) -> models.Field[Any, Any]:
    """The concrete field a template name stands for (by name or attname; pk = the pk)."""
    opts = model._meta
    if name == "pk":
        assert opts.pk is not None
        return opts.pk
    for field in opts.concrete_fields:
        if name in (field.name, field.attname):
            return field
    raise FieldDoesNotExist(f"{opts.label} has no field {name!r}")


def column_type(field: models.Field[Any, Any]) -> str:
    """The internal type of the column ``field`` stores (a foreign key's target's)."""
    while field.is_relation and field.target_field is not None:  # type: ignore[attr-defined]
        field = field.target_field  # type: ignore[attr-defined]
    return field.get_internal_type()


def template_problems(model: type[models.Model]) -> list[str]:
    """What is wrong with ``model.fence_name`` (empty list when it is usable, also in SQL)."""
    try:
        parts = parse_fence_name(model.fence_name)  # type: ignore[attr-defined]
    except ValueError as exc:
        return [str(exc)]
    problems = []
    for _, name in parts:
        if name is None:
            continue
        try:
            field = resolve(model, name)
        except FieldDoesNotExist as exc:
            problems.append(str(exc))
            continue
        kind = column_type(field)
        if kind not in INTEGER_TYPES | TEXT_TYPES:
            problems.append(
                f"fence_name field {name!r} is a {kind}; only integer and text columns "
                "can be turned into the lock name in SQL"
            )
    return problems


def nullable_template_fields(model: type[models.Model]) -> list[str]:
    """The fields of a usable ``fence_name`` template that allow NULL (system check E012).

    A NULL has no lock name both definitions agree on: ``str.format`` writes ``None``,
    SQL's concatenation an empty string (and a one-field name test matches no row). Only
    NOT NULL fields keep get_fence_name() and its SQL form equal by construction.
    """
    if template_problems(model):
        return []
    names = field_names(model.fence_name)  # type: ignore[attr-defined]
    return [name for name in dict.fromkeys(names) if resolve(model, name).null]


def stored_value(model: type[models.Model], field: Any, name: str, value: Any) -> Any:
    """``value`` as ``field``'s column will hold it, for a lock name spelled as SQL spells it.

    ``"07"`` assigned to an IntegerField is stored as 7, so its row is named ``"x:7"``,
    never ``"x:07"`` (which a lease could be taken for). ValueError for None (SQL has no
    name for such a row either) and for an expression (its value is known only in SQL).
    """
    if hasattr(value, "resolve_expression"):
        raise ValueError(
            f"{model._meta.label}: the lock name's field {name!r} is set to an expression "
            f"({value!r}), whose lock name is known only in SQL; assign a value, or use "
            "fenced_update(), which checks the name of such a change in the database"
        )
    if isinstance(value, models.Model) and field.is_relation:
        value = value.prepare_database_save(field)
    stored = None if value is None else field.get_prep_value(value)
    if stored is None:
        raise ValueError(
            f"{model._meta.label} object has no lock name: its field {name!r} is None"
        )
    return stored


def format_name(model: type[models.Model], template: str, instance: models.Model) -> str:
    """The lock name of ``instance`` by ``template``, from the values its columns store."""
    values = {}
    for name in field_names(template):
        field = resolve(model, name)
        values[name] = stored_value(model, field, name, getattr(instance, field.attname))
    return template.format(**values)


def name_expression(model: type[models.Model], template: str) -> Any:
    """SQL expression of each row's lock name by ``template``; None if it has no field."""
    parts: list[Any] = []
    for literal, name in parse_fence_name(template):
        if literal:
            parts.append(Value(literal, output_field=models.TextField()))
        if name is not None:
            field = resolve(model, name)
            if column_type(field) in TEXT_TYPES:
                parts.append(F(field.attname))
            else:
                parts.append(Cast(F(field.attname), output_field=models.TextField()))
    if all(isinstance(part, Value) for part in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    # Text literals and CharField columns: without one output type Django refuses to
    # mix them (FieldError "mixed types") wherever the expression is resolved.
    return Concat(*parts, output_field=models.TextField())


def from_template(method: C) -> C:
    """Mark FencedModel's own ``get_fence_name_expression`` (the one built from the
    template): :func:`uses_template` tells an override by the mark's absence."""
    method._distlock_from_template = True  # type: ignore[attr-defined]
    return method


def uses_template(model: type[models.Model]) -> bool:
    """True if the model's names come from ``fence_name`` alone (no overridden SQL form)."""
    return getattr(model, "fence_name", None) is not None and getattr(
        model.get_fence_name_expression, "_distlock_from_template", False  # type: ignore[attr-defined]
    )


@functools.lru_cache(maxsize=256)
def _template_field(model: type[models.Model], template: str) -> tuple[str, str, Any] | None:
    """(prefix, suffix, field) of a one-field template such as ``"account:{pk}"``."""
    fields = field_names(template)
    if len(fields) != 1:
        return None
    # Lock names never contain NUL, so it marks the field's place unambiguously.
    prefix, suffix = template.format(**{fields[0]: "\x00"}).split("\x00")
    return prefix, suffix, resolve(model, fields[0])


def inversion(model: type[models.Model], name: str) -> tuple[Any, int | str] | object | None:
    """(field, value) such that the rows of lock ``name`` are those whose field equals the
    value, for a ``fence_name`` of one field (``"account:{pk}"`` and ``"account:42"``
    give (pk, 42)); NO_ROW if the template cannot produce ``name``; None when the
    template has no field or several, or the model computes its names itself.
    """
    if not uses_template(model):
        return None
    parts = _template_field(model, model.fence_name)  # type: ignore[attr-defined]
    if parts is None:
        return None
    prefix, suffix, field = parts
    if len(name) < len(prefix) + len(suffix) or not (
        name.startswith(prefix) and name.endswith(suffix)
    ):
        return NO_ROW
    value = name[len(prefix): len(name) - len(suffix)]
    if column_type(field) in INTEGER_TYPES:
        # str() of the stored integer must give back exactly this text ("7", never "07").
        if not _DECIMAL.fullmatch(value) or str(int(value)) != value:
            return NO_ROW
        if not -(2**63) <= int(value) < 2**63:
            return NO_ROW
        return field, int(value)
    return field, value


def columns_read(expression: Any) -> set[str] | None:
    """Names of the model's columns that ``expression`` reads (``F("a") + 1``: {"a"});
    None if it may read more than its tree shows (a subquery, which can read any row, or
    raw SQL)."""
    names: set[str] = set()
    stack = [expression]
    while stack:
        node = stack.pop()
        if isinstance(node, F):
            names.add(node.name.split(LOOKUP_SEP, 1)[0])  # type: ignore[attr-defined]
        elif isinstance(node, models.QuerySet | RawSQL) or getattr(node, "subquery", False):
            return None
        elif isinstance(node, Q):
            for child in node.children:
                if isinstance(child, tuple):
                    names.add(child[0].split(LOOKUP_SEP, 1)[0])
                    stack.append(child[1])
                else:
                    stack.append(child)
        elif hasattr(node, "get_source_expressions"):
            stack.extend(part for part in node.get_source_expressions() if part is not None)
    return names


@functools.lru_cache(maxsize=256)
def name_fields(model: type[models.Model]) -> frozenset[Any] | None:
    """The concrete fields the rows' lock names are built from; None when that cannot be
    told (get_fence_name() without an SQL form, or a form with a subquery)."""
    if uses_template(model):
        names = field_names(model.fence_name)  # type: ignore[attr-defined]
        return frozenset(resolve(model, name) for name in names)
    try:
        expression = model.get_fence_name_expression()  # type: ignore[attr-defined]
    except NotImplementedError:
        return None
    read = set() if expression is None else columns_read(expression)
    if read is None:
        return None
    try:
        return frozenset(resolve(model, name) for name in read)
    except FieldDoesNotExist:
        return None


@functools.lru_cache(maxsize=256)
def name_keys(model: type[models.Model]) -> frozenset[str]:
    """The names and attnames of :func:`name_fields` (how a change may spell them)."""
    fields = name_fields(model) or ()
    return frozenset(f.name for f in fields) | frozenset(f.attname for f in fields)


def constant_name(model: type[models.Model]) -> str | None:
    """The one lock name of every row, when ``fence_name`` has no field; else None."""
    template = getattr(model, "fence_name", None)
    return None if template is None else _constant_template(template)


@functools.lru_cache(maxsize=256)
def _constant_template(template: str) -> str | None:
    parts = parse_fence_name(template)
    return template if all(field is None for _, field in parts) else None


@functools.lru_cache(maxsize=256)
def local_columns(model: type[models.Model]) -> frozenset[str]:
    """Names and attnames of the model's own table's columns."""
    fields = model._meta.local_concrete_fields
    return frozenset(f.name for f in fields) | frozenset(f.attname for f in fields)
