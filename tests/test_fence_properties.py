"""Property-based fenced writes: a row never leaves, nor joins, a lock it was not written under.

hypothesis generates rows of models whose lock names come from one integer field
(``Order``, ``Account``'s pk), two text fields (``Sheet``) and an integer and a text field
(``Slot``), from small domains so that names collide, differ only in case, spacing or
Unicode form, or split ambiguously ("sheet:a:b:" is book "a", tab "b:" and book "a:b",
tab ""). Then a lease for some name and one fenced write: ``fenced_update`` (values and
expressions for fields of the name and others), ``save(fence=)`` of a changed instance
(with or without ``update_fields``), ``fenced_create``, ``delete(fence=)`` and
``fenced_delete``. The properties, for every example:

* an accepted write touched only rows named by the lease's lock, both before and after it
  (names computed here from the stored values, independently of distlock), and every row
  it wrote carries the lease's token;
* a refused write raised ValueError (the lease is current: never StaleToken), changed
  nothing and left the lease good;
* where the outcome follows from values alone (no expressions), it is the predicted one,
  so the properties above are not satisfied by refusing everything;
* Python's lock name of every row is the one its SQL form computes.

Each example cleans its model's table and releases its lease, as leases commit on their
own (transactional tests). Example counts keep the file well under 30 s per backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import connection
from django.db.models import F, Model, Q, Value
from django.db.models.functions import Concat, Lower, Upper
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from distlock import StaleToken, acquire
from tests.testapp.models import Account, Order, Sheet, Slot

pytestmark = pytest.mark.usefixtures("lock_db")

# The database is shared by the examples of one test function; each cleans up after
# itself. database=None: no .hypothesis/ folder in the work tree.
PROPS = settings(
    max_examples=50, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

TEXTS = ["", "a", "A", "a ", "a:", ":a", "a:b", "b", "b:", "/", "1", "é", "e\u0301"]
text = st.sampled_from(TEXTS)
number = st.integers(-2, 3)
# Values a caller may assign: Django stores "07" in an IntegerField as 7, 1 in a
# CharField as "1"; names must follow the stored value.
number_value = st.one_of(number, st.sampled_from(["07", "+3", "-0", "2"]))
text_value = st.one_of(text, st.integers(0, 2))


@dataclass(frozen=True)
class Spec:
    """A model under test: the fields of its lock name, and how to generate values."""

    model: type[Model]
    name_fields: dict[str, str]  # template name -> attname
    kinds: dict[str, str]  # attname -> "int" | "text", for every generated field
    other: str  # a field outside the name
    expressions: Callable[[str], list[Any]] = field(default=lambda attname: [])

    def name(self, row: dict[str, Any]) -> str:
        """The lock name of a stored row, by str.format over its stored values."""
        return self.model.fence_name.format(  # type: ignore[attr-defined]
            **{key: row[attname] for key, attname in self.name_fields.items()}
        )

    def stored(self, attname: str, value: Any) -> Any:
        """What the column keeps of an assigned value (the oracle's own conversion)."""
        return int(value) if self.kinds.get(attname, "int") == "int" else str(value)

    def strategy(self, attname: str, *, assigned: bool) -> st.SearchStrategy[Any]:
        if self.kinds[attname] == "int":
            return number_value if assigned else number
        return text_value if assigned else text


def _int_expressions(attname: str, other: str) -> list[Any]:
    return [F(attname) + 0, F(attname) + 1, F(attname) - 1, F(other) + 0]


SPECS = [
    Spec(
        Order, {"customer_id": "customer_id"},
        {"customer_id": "int", "amount": "int"}, "amount",
        lambda attname: _int_expressions(attname, "amount"),
    ),
    Spec(
        Sheet, {"book": "book", "tab": "tab"}, {"book": "text", "tab": "text", "body": "text"},
        "body",
        lambda attname: [
            F(attname), F("tab" if attname == "book" else "book"), Lower(attname),
            Upper(attname), Concat(F(attname), Value(":")), Concat(Value(""), F(attname)),
        ],
    ),
    Spec(
        Slot, {"day": "day", "label": "label"},
        {"day": "int", "label": "text", "booked": "int"}, "booked",
        lambda attname: (
            _int_expressions(attname, "booked") if attname == "day"
            else [F(attname), Lower(attname), Concat(F(attname), Value("/"))]
        ),
    ),
    Spec(
        Account, {"pk": "id"}, {"id": "int", "balance": "int"}, "balance",
        lambda attname: [F("id") + 0, F("id") + 1],
    ),
]


def snapshot(spec: Spec) -> dict[Any, dict[str, Any]]:
    return {row["id"]: row for row in spec.model.objects.values()}


def assert_names_agree(spec: Spec) -> None:
    """get_fence_name(), its SQL form and the oracle name every stored row alike."""
    model = spec.model
    in_sql = dict(
        model.objects.annotate(lock=model.get_fence_name_expression()).values_list("pk", "lock")
    )
    for obj in model.objects.all():
        row = {attname: getattr(obj, attname) for attname in spec.name_fields.values()}
        assert obj.get_fence_name() == spec.name(row) == in_sql[obj.pk]


@st.composite
def scene(draw: st.DrawFn) -> tuple[Spec, list[dict[str, Any]], str]:
    """A model, its rows (1–5) and a lease name: a row's, or one spelled from the domain."""
    spec = draw(st.sampled_from(SPECS))
    count = draw(st.integers(1, 5))
    rows = []
    pks = draw(st.lists(st.integers(1, 9), min_size=count, max_size=count, unique=True))
    for pk in pks:
        row = {"id": pk}
        for attname in spec.kinds:
            if attname != "id":
                row[attname] = draw(spec.strategy(attname, assigned=False))
        rows.append(row)
    spelled = {
        key: draw(spec.strategy(attname, assigned=True))
        for key, attname in spec.name_fields.items()
    }
    name = draw(st.one_of(
        st.sampled_from([spec.name(row) for row in rows]),
        st.just(spec.model.fence_name.format(**spelled)),  # type: ignore[attr-defined]
    ))
    return spec, rows, name


def run(spec: Spec, rows: list[dict[str, Any]], name: str, write: Callable[..., Any],
        expected: Callable[[dict[Any, dict[str, Any]]], bool | None]) -> None:
    """Set up ``rows``, take a lease for ``name``, ``write(lease)`` and check the properties.

    ``expected(before)`` predicts acceptance from the stored rows (None: no prediction).
    """
    model = spec.model
    model.objects.all().delete()
    model.objects.bulk_create([model(**row) for row in rows])
    lease = acquire(name, ttl=30, blocking=False)
    assert lease is not None
    try:
        assert_names_agree(spec)
        before = snapshot(spec)
        prediction = expected(before)
        try:
            write(lease)
        except StaleToken as exc:  # the lease is current: never a stale refusal
            raise AssertionError(f"a current lease was refused as stale: {exc}") from exc
        except ValueError:
            accepted = False
        else:
            accepted = True
        after = snapshot(spec)
        # Shown by --hypothesis-show-statistics: how often each side of the property ran.
        event("accepted" if accepted else "refused")
        event("predicted" if prediction is not None else "expression: not predicted")
        if accepted:
            for pk in before.keys() | after.keys():
                if before.get(pk) == after.get(pk):
                    continue
                if pk in before:
                    assert spec.name(before[pk]) == name, ("took a row of", before[pk])
                if pk in after:
                    assert spec.name(after[pk]) == name, ("gave a row another lock", after[pk])
                    assert after[pk]["fence_token"] == lease.token
        else:
            assert after == before, "a refused write changed rows"
        assert not lease.lost
        if prediction is not None:
            assert accepted == prediction
        assert_names_agree(spec)
    finally:
        lease.release()
        model.objects.all().delete()


def rows_matching(spec: Spec, rows: list[dict[str, Any]], draw: st.DrawFn) -> Q:
    """A filter: everything, some pks, or one field of the name equal to a value."""
    choice = draw(st.sampled_from(["all", "pks", "field"]))
    if choice == "all":
        return Q()
    if choice == "pks":
        pks = draw(st.lists(st.sampled_from([row["id"] for row in rows]), max_size=3))
        return Q(pk__in=pks)
    attname = draw(st.sampled_from(sorted(spec.name_fields.values())))
    return Q(**{attname: draw(spec.strategy(attname, assigned=False))})


@PROPS
@given(setup=scene(), data=st.data())
def test_fenced_update_keeps_every_row_under_the_lease(setup, data):
    spec, rows, name = setup
    where = rows_matching(spec, rows, data.draw)
    changes: dict[str, Any] = {}
    plain = True
    for attname in spec.name_fields.values():
        how = data.draw(st.sampled_from(["value", "expression", "keep"]), label=attname)
        if how == "value":
            changes[attname] = data.draw(spec.strategy(attname, assigned=True))
        elif how == "expression" and spec.expressions(attname):
            changes[attname] = data.draw(st.sampled_from(spec.expressions(attname)))
            plain = False
    if data.draw(st.booleans(), label="other field"):
        changes[spec.other] = data.draw(spec.strategy(spec.other, assigned=False))

    matched: list[Any] = []  # the rows the filter matches before the write

    def write(lease):
        count = spec.model.objects.filter(where).fenced_update(lease, **changes)
        assert count == len(matched)

    def expected(before):
        matched.extend(spec.model.objects.filter(where).values_list("pk", flat=True))
        if not plain:
            return None
        assigned = {
            attname: spec.stored(attname, value) for attname, value in changes.items()
            if attname in spec.name_fields.values()
        }
        if len(assigned) == len(spec.name_fields) and spec.name(assigned) != name:
            return False  # every field of the name gets a value: compared before any SQL
        if assigned.get("id") == 0 and not connection.features.allows_auto_pk_0:
            return False  # Django refuses 0 for an AutoField here (MariaDB/MySQL)
        return all(
            spec.name(before[pk]) == name and spec.name({**before[pk], **assigned}) == name
            for pk in matched
        )

    run(spec, rows, name, write, expected)


@PROPS
@given(setup=scene(), data=st.data())
def test_fenced_save_keeps_the_row_under_the_lease(setup, data):
    spec, rows, name = setup
    pk = data.draw(st.sampled_from([row["id"] for row in rows]))
    editable = [a for a in spec.kinds if a != "id"]
    edits = {
        attname: data.draw(spec.strategy(attname, assigned=True), label=attname)
        for attname in data.draw(st.lists(st.sampled_from(editable), unique=True))
    }
    update_fields = data.draw(st.one_of(
        st.none(), st.lists(st.sampled_from(editable), min_size=1, unique=True),
    ))

    def write(lease):
        obj = spec.model.objects.get(pk=pk)
        for attname, value in edits.items():
            setattr(obj, attname, value)
        obj.save(fence=lease, update_fields=update_fields)

    def expected(before):
        stored = before[pk]
        instance = {**stored, **{a: spec.stored(a, v) for a, v in edits.items()}}
        written = editable if update_fields is None else update_fields
        new = {**stored, **{a: instance[a] for a in written}}
        return spec.name(instance) == spec.name(stored) == spec.name(new) == name

    run(spec, rows, name, write, expected)


@PROPS
@given(setup=scene(), data=st.data())
def test_fenced_create_makes_only_rows_of_the_lease(setup, data):
    spec, rows, name = setup
    values = {
        attname: data.draw(spec.strategy(attname, assigned=True), label=attname)
        for attname in spec.kinds if attname != "id"
    }
    # A free pk: the property is about names, not about a duplicate key.
    values["id"] = data.draw(
        st.integers(1, 12).filter(lambda pk: pk not in {row["id"] for row in rows})
    )
    own = spec.name({a: spec.stored(a, v) for a, v in values.items()})
    name = data.draw(st.sampled_from([name, own]), label="lease")  # the row's own, often

    def write(lease):
        created = spec.model.objects.fenced_create(lease, **values)
        assert created.fence_token == lease.token

    def expected(before):
        return spec.name({a: spec.stored(a, v) for a, v in values.items()}) == name

    run(spec, rows, name, write, expected)


@PROPS
@given(setup=scene(), data=st.data())
def test_fenced_deletes_remove_only_rows_of_the_lease(setup, data):
    spec, rows, name = setup
    if data.draw(st.booleans(), label="one instance"):
        pk = data.draw(st.sampled_from([row["id"] for row in rows]))
        names = [a for a in spec.name_fields.values() if a != "id"]
        changed = data.draw(st.lists(st.sampled_from(names), unique=True)) if names else []
        edits = {
            attname: data.draw(spec.strategy(attname, assigned=True), label=attname)
            for attname in changed
        }

        def write(lease):
            obj = spec.model.objects.get(pk=pk)
            for attname, value in edits.items():
                setattr(obj, attname, value)
            obj.delete(fence=lease)

        def expected(before):
            instance = {**before[pk], **{a: spec.stored(a, v) for a, v in edits.items()}}
            return spec.name(instance) == spec.name(before[pk]) == name
    else:
        where = rows_matching(spec, rows, data.draw)

        def write(lease):
            spec.model.objects.filter(where).fenced_delete(lease)

        def expected(before):
            matched = spec.model.objects.filter(where).values_list("pk", flat=True)
            return all(spec.name(before[pk]) == name for pk in matched)

    run(spec, rows, name, write, expected)
