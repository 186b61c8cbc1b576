"""The fenced condition: which rows a lease may write, as one WHERE clause.

Every fenced write (``save(fence=)``'s UPDATE, ``fenced_update``, the claim before a
fenced delete) narrows its rows with :meth:`Fence.narrow`, the one builder of

    fence_token <= :token  AND  <row's lock name> = :name   (byte for byte: SameName)
    [AND <row's lock name after the update> = :name]  [AND <ownership check>]

so that all write forms decide alike. :class:`NameTest` is how a write tells the rows of
one lock, and :func:`name_after` the check that an update does not move a row to
another lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, cast

from django.core.exceptions import FieldDoesNotExist
from django.db import models
from django.db.models import Exists, F, Q, Value
from django.db.models.expressions import Col
from django.db.models.lookups import Exact, LessThanOrEqual
from django.db.models.sql.where import AND

from distlock.constants import FENCE_FIELD
from distlock.fencing.ownership import LeaseHolds, SameName
from distlock.fencing.templates import (
    NO_ROW,
    columns_read,
    field_names,
    inversion,
    name_fields,
    resolve,
    uses_template,
)

if TYPE_CHECKING:
    from distlock.core.leases import Lease

#: (field, value) pairs: "the row whose ``field`` equals ``value``".
Pins = Sequence[tuple[Any, Any]]


class NameTest(NamedTuple):
    """How a write tells the rows of one lock: the row's lock name, computed in SQL, is it.

    ``q`` is that WHERE condition (None when every row has the same lock name, which the
    caller compares once, or the model gives no SQL form of its names). ``column`` is set
    when the condition is one column's value (:func:`~distlock.fencing.templates.inversion`'s
    (field, value)), so it can also be built without ``filter()``.
    """

    column: tuple[Any, int | str] | None
    q: Q | None
    #: For an update that assigns fields of the name: the rows' name *after* it is also the
    #: lease's (see :func:`name_after`), so no write moves a row to another lock.
    after: Q | None = None

    @property
    def direct(self) -> bool:
        """True if it can be added to a WHERE directly (one column, or no condition)."""
        return self.after is None and (self.column is not None or self.q is None)


def name_test(model: type[models.Model], name: str, *, required: bool) -> NameTest:
    """The :class:`NameTest` of lock ``name``; NotImplementedError if ``required`` and the
    model has no SQL form of its lock names.

    For a one-field template (``"account:{pk}"``) the name test is a test of that field
    (``pk = 42`` for ``"account:42"``), instead of building every row's name in SQL:
    exactly the rows whose name is ``name`` match (a NULL field matches no lease), and a
    name the template cannot produce matches no row.
    """
    found = inversion(model, name)
    if found is NO_ROW:
        return NameTest(None, Q(pk__in=[]))
    if found is not None:
        field, value = cast(tuple[Any, int | str], found)
        if isinstance(value, int):
            return NameTest((field, value), Q(**{field.attname: value}))
        return NameTest((field, value), Q(SameName(F(field.attname), value)))
    try:
        expression = model.get_fence_name_expression()  # type: ignore[attr-defined]
    except NotImplementedError:
        if required:
            raise
        return NameTest(None, None)
    return NameTest(None, None if expression is None else Q(SameName(expression, name)))


def refuse_other_lock(model: type[models.Model], lease: Lease, name: str, what: str) -> NoReturn:
    """ValueError: ``lease`` is for another lock than the one guarding the rows."""
    raise ValueError(
        f"lease for lock {lease.name!r} cannot fence {what} of {model._meta.label}: "
        f"that row is guarded by lock {name!r}"
    )


def _refuse_move(model: type[models.Model], lease: Lease, why: str) -> NoReturn:
    raise ValueError(
        f"lease for lock {lease.name!r} cannot move rows of {model._meta.label} to another "
        f"lock: {why}"
    )


def name_after(
    model: type[models.Model], lease: Lease, assigned: dict[Any, Any], *,
    written: Iterable[Any],
) -> Q | None:
    """The WHERE condition "the row's lock name after this UPDATE is the lease's".

    ``assigned`` maps each field of the name that the UPDATE sets to its new value (a
    value as stored, or an expression); ``written`` is every column the UPDATE sets. None
    when no condition is needed: nothing of the name changes, or every field of a
    template gets a value and the new name is the lease's (then decided here, in Python,
    and a different one raises ValueError before any SQL). An expression is checked in
    SQL: the name expression with the expression in the field's place must equal the
    lease's name, row by row, evaluated on the row as it was (as the UPDATE's SET is).
    """
    if not assigned:
        return None
    fields = name_fields(model)
    if fields is None:
        _refuse_move(model, lease, (
            "distlock cannot tell which columns make its lock names, so it cannot check "
            "that this update keeps them"
        ))
    written = set(written)
    for field, value in assigned.items():
        if not hasattr(value, "resolve_expression"):
            continue
        read = columns_read(value)
        if read is None:
            _refuse_move(model, lease, (
                f"{field.name!r} is set to a subquery or raw SQL; the lock name's fields "
                "take values or expressions over the row's own columns"
            ))
        try:
            others = {resolve(model, name) for name in read} - {field}
        except FieldDoesNotExist:
            others = set(written)
        if others & written:
            # MariaDB and MySQL evaluate SET left to right: the new name could depend on
            # a column this UPDATE has already changed, unlike in the WHERE.
            _refuse_move(model, lease, (
                f"{field.name!r} is set to an expression over columns this update also "
                "changes"
            ))
    if uses_template(model) and set(assigned) == fields and not any(
        hasattr(value, "resolve_expression") for value in assigned.values()
    ):
        template: str = model.fence_name  # type: ignore[attr-defined]
        values = {name: assigned[resolve(model, name)] for name in field_names(template)}
        new = template.format(**values)
        if new != lease.guard_name:
            _refuse_move(model, lease, f"the update would give them lock {new!r}")
        return None
    replacements: dict[Any, Any] = {}
    for field, value in assigned.items():
        if not hasattr(value, "resolve_expression"):
            value = Value(value, output_field=field)
        replacements[F(field.attname)] = replacements[F(field.name)] = value
    expression = model.get_fence_name_expression()  # type: ignore[attr-defined]
    return Q(SameName(expression.replace_expressions(replacements), lease.guard_name))


def pinned(query: Any) -> list[tuple[Any, Any]]:
    """The (unique field, value) pairs the filter ANDs in (``pk=42``: [(pk, 42)]).

    Not empty: the query matches at most one row, whatever else it says.
    """
    where = query.where
    if where.negated or where.connector != AND or query.is_sliced or query.combinator:
        return []
    return [
        (child.lhs.target, child.rhs) for child in where.children
        if isinstance(child, Exact) and isinstance(child.lhs, Col)
        and child.lhs.target.unique and child.lhs.target.model is query.model
        and child.rhs_is_direct_value() and child.rhs is not None
    ]


def _unpinned(column: tuple[Any, int | str] | None, pins: Pins) -> tuple[Any, int | str] | None:
    """The one-column name test ``column`` a write pinned by ``pins`` still needs: None
    when a pin is that test already.

    Only an integer pin is: ``filter(pk=42)`` under lock ``"account:42"`` selects
    exactly the row whose ``id`` is 42. A text pin is not, whatever its value: the
    column's ``=`` follows its collation, and a folding one (MariaDB's default
    ``utf8mb4_general_ci``, a PostgreSQL nondeterministic ICU collation, SQLite's NOCASE
    or RTRIM) makes ``filter(key="abc")`` find the row ``"ABC"``, another lock's (DESIGN
    invariant 10). Its name test stays, the exact comparison of ``SameName``.
    """
    if column is not None and isinstance(column[1], int) and column in pins:
        return None
    return column


class Fence(NamedTuple):
    """The fenced condition of one write: the rows a lease with ``token`` may write.

    ``name`` tells the rows of the lease's lock, ``holds`` is the ownership check folded
    into the statement (None when it runs as a separate locking read, or not at all).
    """

    token: int
    name: NameTest
    holds: LeaseHolds | None = None

    def refused(self) -> Q:
        """The rows a write matches but may not write: a newer token wrote them, or they
        are (or after the update would be) another lock's."""
        refused = Q(fence_token__gt=self.token)
        if self.name.q is not None:
            refused |= ~self.name.q
        if self.name.after is not None:
            refused |= ~self.name.after
        return refused

    def narrow(
        self, rows: models.QuerySet[Any], *, pins: Pins | None = None,
    ) -> models.QuerySet[Any]:
        """``rows`` narrowed to those this write may change: the one fenced condition.

        ``pins`` are the unique (field, value) pairs that make ``rows`` one row at most
        (default: read from its filter; save() passes the pk Django filters by next).
        With the ownership check folded in and several rows, the statement must also
        write all or none: it requires that no row of ``rows`` is refused.
        """
        if pins is None:
            pins = pinned(rows.query)
        if self.holds is not None and pins and self.name.direct:
            return self._narrow_directly(rows, _unpinned(self.name.column, pins), self.holds)
        condition = Q(fence_token__lte=self.token)
        for part in (self.name.q, self.name.after):
            if part is not None:
                condition &= part
        if self.holds is not None:
            condition &= Q(self.holds)
        if self.holds is not None and not pins:
            condition &= Q(~Exists(rows.filter(self.refused())))
        # One filter() call: each one clones and resolves the query again.
        return rows.filter(condition)

    def _narrow_directly(
        self, rows: models.QuerySet[Any], column: tuple[Any, int | str] | None,
        holds: LeaseHolds,
    ) -> models.QuerySet[Any]:
        """What :meth:`narrow`'s ``filter()`` builds, with the lookups made directly:
        resolving them through ``filter()`` on every write was most of a fenced write's
        client CPU (see benchmarks/). Only for a query whose WHERE is an AND."""
        rows = rows._chain()  # type: ignore[attr-defined]
        query = rows.query
        alias = query.get_initial_alias()
        where = query.where
        fence = rows.model._meta.get_field(FENCE_FIELD)
        where.add(LessThanOrEqual(Col(alias, fence), self.token), AND)
        if column is not None:
            field, value = column
            col = Col(alias, field)
            where.add(
                Exact(col, value) if isinstance(value, int) else SameName(col, value), AND
            )
        where.add(holds, AND)
        return rows
