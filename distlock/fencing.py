"""Fenced writes: the protected rows themselves refuse a stale lock holder.

A :class:`FencedModel` row carries ``fence_token``, the highest fencing token written to
it, and declares which lock guards it (``fence_name``, a ``str.format`` template over its
fields, or :meth:`FencedModel.get_fence_name`). Every fenced write runs in one
transaction on the model's database and is decided there, never by Python:

1. *Ownership check* (when the lock table lives in the same database): a locking read of
   the lock row that requires this lease's owner and token and an expiry later than the
   database's real-time clock. It holds a shared row lock (SQLite: the IMMEDIATE write
   lock) until the write commits, so a take-over waits for the commit, and a lease that
   has run out can commit nothing at all.
2. *High-water mark*: one conditional statement, ``UPDATE … SET fence_token = :token
   WHERE … AND fence_token <= :token`` (plus the row's lock name, computed in SQL). No
   row matched means a newer token wrote the row first.

On PostgreSQL, outside the caller's ``atomic()``, ``save(fence=)`` of an existing row and
``fenced_update`` are *one* autocommit statement: the ownership check is folded into the
conditional UPDATE as ``(SELECT distlock_holds(…))`` (the same locking read, FOR SHARE,
in a function of migration 0002), which PostgreSQL runs once, before it writes a row,
holding the share lock until the statement commits. Same check, same lock,
one round trip and one commit instead of five (see the README, Performance).

A refusal raises :class:`~distlock.exceptions.StaleToken`, writes nothing (the statement
matched no row, or the transaction is rolled back: a savepoint inside the caller's
``atomic()``), marks the lease lost and sends ``stale_write_refused``.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

from django.apps import apps
from django.core.exceptions import FieldDoesNotExist, ImproperlyConfigured
from django.db import connections, models, router, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import Exists, F, Q, Value
from django.db.models.constants import LOOKUP_SEP
from django.db.models.expressions import Col, Expression, RawSQL
from django.db.models.functions import Cast, Concat
from django.db.models.lookups import Exact, LessThanOrEqual
from django.db.models.signals import class_prepared
from django.db.models.sql.where import AND

from distlock import db, signals, uncommitted
from distlock.constants import FENCE_FIELD, LOCK_TABLE
from distlock.exceptions import StaleToken

if TYPE_CHECKING:
    from django.db.models.sql.compiler import SQLCompiler

    from distlock.leases import Lease

__all__ = ["FENCE_FIELD", "FencedManager", "FencedModel", "FencedQuerySet"]

T = TypeVar("T")
M = TypeVar("M", bound="FencedModel")

# Column types whose SQL text form equals Python's str() of the value, so a lock name
# built in SQL matches the one built by str.format.
_INTEGER_TYPES = {
    "AutoField", "BigAutoField", "SmallAutoField", "IntegerField", "BigIntegerField",
    "SmallIntegerField", "PositiveIntegerField", "PositiveBigIntegerField",
    "PositiveSmallIntegerField",
}
_TEXT_TYPES = {"CharField", "TextField", "SlugField"}
_DECIMAL = re.compile(r"-?[0-9]+")


class _Refused(Exception):
    """Internal: the database refused the write (raised inside the transaction)."""

    def __init__(self, by_owner_check: bool) -> None:
        super().__init__()
        self.by_owner_check = by_owner_check


class _OtherLock(Exception):
    """Internal: a row the write would touch is guarded by another lock."""


# -- lock names ------------------------------------------------------------------------


def parse_fence_name(template: object) -> list[tuple[str, str | None]]:
    """Split a ``fence_name`` template into (literal text, field name or None) pairs.

    Only plain named fields are allowed (``{pk}``, ``{customer_id}``): a format spec,
    conversion, index or attribute has no faithful SQL equivalent. Raises ValueError.
    """
    if not isinstance(template, str) or not template:
        raise ValueError(f"fence_name must be a non-empty str, not {template!r}")
    parts: list[tuple[str, str | None]] = []
    for literal, field, spec, conversion in string.Formatter().parse(template):
        if field is not None:
            if not field.isidentifier():
                raise ValueError(
                    f"fence_name {template!r}: field {{{field}}} must be a field name "
                    "such as {pk} or {customer_id} (no positions, indexes or attributes)"
                )
            if spec or conversion:
                raise ValueError(
                    f"fence_name {template!r}: field {{{field}}} must not have a format "
                    "spec or conversion"
                )
        parts.append((literal, field))
    return parts


def _resolve(model: type[models.Model], name: str) -> models.Field[Any, Any]:
    """The concrete field a template name stands for (by name or attname; pk = the pk)."""
    opts = model._meta
    if name == "pk":
        assert opts.pk is not None
        return opts.pk
    for field in opts.concrete_fields:
        if name in (field.name, field.attname):
            return field
    raise FieldDoesNotExist(f"{opts.label} has no field {name!r}")


def _column_type(field: models.Field[Any, Any]) -> str:
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
            field = _resolve(model, name)
        except FieldDoesNotExist as exc:
            problems.append(str(exc))
            continue
        kind = _column_type(field)
        if kind not in _INTEGER_TYPES | _TEXT_TYPES:
            problems.append(
                f"fence_name field {name!r} is a {kind}; only integer and text columns "
                "can be turned into the lock name in SQL"
            )
    return problems


def _stored_value(model: type[models.Model], field: Any, name: str, value: Any) -> Any:
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


def nullable_template_fields(model: type[models.Model]) -> list[str]:
    """The fields of a usable ``fence_name`` template that allow NULL (system check E012).

    A NULL has no lock name both definitions agree on: ``str.format`` writes ``None``,
    SQL's concatenation an empty string (and a one-field name test matches no row). Only
    NOT NULL fields keep get_fence_name() and its SQL form equal by construction.
    """
    if template_problems(model):
        return []
    names = [name for _, name in parse_fence_name(model.fence_name) if name is not None]  # type: ignore[attr-defined]
    return [name for name in dict.fromkeys(names) if _resolve(model, name).null]


class _SameName(Expression):
    """``<lock name of the row> = %s``, compared byte for byte, never NULL."""

    conditional = True
    output_field = models.BooleanField()

    def __init__(self, expression: Any, name: str) -> None:
        super().__init__()
        self.expression = expression
        self.name = name

    def get_source_expressions(self) -> list[Any]:
        return [self.expression]

    def set_source_expressions(self, exprs: list[Any]) -> None:
        (self.expression,) = exprs

    def as_sql(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra: Any
    ) -> tuple[str, list[Any]]:
        sql, params = compiler.compile(self.expression)
        if connection.vendor == "mysql":
            # The default collations fold case, accents and trailing spaces.
            return (
                f"COALESCE(CAST({sql} AS BINARY) = CAST(%s AS BINARY), 0)",
                [*params, self.name],
            )
        false = "FALSE" if connection.vendor == "postgresql" else "0"
        return f"COALESCE(({sql}) = %s, {false})", [*params, self.name]


# _inversion(): no row can be guarded by that lock name.
_NO_ROW = object()


@functools.lru_cache(maxsize=256)
def _template_field(model: type[FencedModel], template: str) -> tuple[str, str, Any] | None:
    """(prefix, suffix, field) of a one-field template such as ``"account:{pk}"``."""
    fields = [field for _, field in parse_fence_name(template) if field is not None]
    if len(fields) != 1:
        return None
    # Lock names never contain NUL, so it marks the field's place unambiguously.
    prefix, suffix = template.format(**{fields[0]: "\x00"}).split("\x00")
    field = _resolve(model, fields[0])
    return prefix, suffix, field


def _inversion(model: type[FencedModel], name: str) -> tuple[Any, int | str] | object | None:
    """(field, value) such that the rows of lock ``name`` are those whose field equals the
    value, for a ``fence_name`` of one field (``"account:{pk}"`` and ``"account:42"``
    give (pk, 42)); _NO_ROW if the template cannot produce ``name``; None when the
    template has no field or several, or the model computes its names itself.
    """
    if not _uses_template(model):
        return None
    parts = _template_field(model, model.fence_name)  # type: ignore[arg-type]
    if parts is None:
        return None
    prefix, suffix, field = parts
    if len(name) < len(prefix) + len(suffix) or not (
        name.startswith(prefix) and name.endswith(suffix)
    ):
        return _NO_ROW
    value = name[len(prefix): len(name) - len(suffix)]
    if _column_type(field) in _INTEGER_TYPES:
        # str() of the stored integer must give back exactly this text ("7", never "07").
        if not _DECIMAL.fullmatch(value) or str(int(value)) != value:
            return _NO_ROW
        if not -(2**63) <= int(value) < 2**63:
            return _NO_ROW
        return field, int(value)
    return field, value


def _with_fence(
    queryset: models.QuerySet[Any], lease: Lease, column: tuple[Any, int | str] | None,
    holds: _LeaseHolds,
) -> models.QuerySet[Any]:
    """``queryset`` narrowed to the rows ``lease`` may write: ``fence_token <= token``, the
    lock name's column condition (``column``: a :class:`_NameTest`'s (field, value), or
    None for none) and the ownership check ``holds``.

    The same WHERE that ``filter()`` builds from the Q objects, with the lookups made
    directly: resolving them through ``filter()`` on every write was most of a fenced
    write's client CPU (see benchmarks/). Only for a query whose WHERE is an AND.
    """
    rows = queryset._chain()
    query = rows.query
    alias = query.get_initial_alias()
    where = query.where
    fence = queryset.model._meta.get_field(FENCE_FIELD)
    where.add(LessThanOrEqual(Col(alias, fence), lease.token), AND)
    if column is not None:
        field, value = column
        col = Col(alias, field)
        where.add(Exact(col, value) if isinstance(value, int) else _SameName(col, value), AND)
    where.add(holds, AND)
    return rows


def _filter_fence(
    queryset: models.QuerySet[Any], lease: Lease, name_test: _NameTest,
    holds: _LeaseHolds | None, *more: Exists,
) -> models.QuerySet[Any]:
    """The :func:`_with_fence` narrowing through ``filter()``, for what it cannot carry (a
    name test that is not one column, a WHERE that is not an AND, no folded check),
    ANDed with ``more``. One filter() call: each one clones and resolves the query again.
    """
    conditions = Q(fence_token__lte=lease.token)
    if name_test.q is not None:
        conditions &= name_test.q
    if name_test.after is not None:
        conditions &= name_test.after
    if holds is not None:
        conditions &= Q(holds)
    for condition in more:
        conditions &= condition
    return queryset.filter(conditions)


class _NameTest(NamedTuple):
    """How a write tells the rows of one lock: the row's lock name, computed in SQL, is it.

    ``q`` is that WHERE condition (None when every row has the same lock name, which the
    caller compares once, or the model gives no SQL form of its names). ``column`` is set
    when the condition is one column's value (:func:`_inversion`'s (field, value)), so it
    can also be built without ``filter()`` (:func:`_with_fence`).
    """

    column: tuple[Any, int | str] | None
    q: Q | None
    #: For an update that assigns fields of the name: the rows' name *after* it is also the
    #: lease's (see :func:`_name_after`), so no write moves a row to another lock.
    after: Q | None = None

    @property
    def direct(self) -> bool:
        """True if :func:`_with_fence` can carry it (one column, or no condition at all)."""
        return self.after is None and (self.column is not None or self.q is None)


def _name_test(model: type[FencedModel], name: str, *, required: bool) -> _NameTest:
    """The :class:`_NameTest` of lock ``name``; NotImplementedError if ``required`` and the
    model has no SQL form of its lock names.

    For a one-field template (``"account:{pk}"``) the name test is a test of that field
    (``pk = 42`` for ``"account:42"``), instead of building every row's name in SQL:
    exactly the rows whose name is ``name`` match (a NULL field matches no lease), and a
    name the template cannot produce matches no row.
    """
    inversion = _inversion(model, name)
    if inversion is _NO_ROW:
        return _NameTest(None, Q(pk__in=[]))
    if inversion is not None:
        field, value = inversion  # type: ignore[misc]
        if isinstance(value, int):
            return _NameTest((field, value), Q(**{field.attname: value}))
        return _NameTest((field, value), Q(_SameName(F(field.attname), value)))
    try:
        expression = model.get_fence_name_expression()
    except NotImplementedError:
        if required:
            raise
        return _NameTest(None, None)
    return _NameTest(None, None if expression is None else Q(_SameName(expression, name)))


def _columns_read(expression: Any) -> set[str] | None:
    """Names of the model's columns that ``expression`` reads (``F("a") + 1``: {"a"});
    None if it may read more than its tree shows (a subquery, which can read any row, or
    raw SQL)."""
    names: set[str] = set()
    stack = [expression]
    while stack:
        node = stack.pop()
        if isinstance(node, F):
            names.add(node.name.split(LOOKUP_SEP, 1)[0])
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


def _uses_template(model: type[FencedModel]) -> bool:
    """True if the model's names come from ``fence_name`` alone (no overridden SQL form)."""
    own = FencedModel.get_fence_name_expression.__func__  # type: ignore[attr-defined]
    return (
        model.fence_name is not None
        and model.get_fence_name_expression.__func__ is own  # type: ignore[attr-defined]
    )


@functools.lru_cache(maxsize=256)
def _name_fields(model: type[FencedModel]) -> frozenset[Any] | None:
    """The concrete fields the rows' lock names are built from; None when that cannot be
    told (get_fence_name() without an SQL form, or a form with a subquery)."""
    if _uses_template(model):
        names = [name for _, name in parse_fence_name(model.fence_name) if name is not None]
        return frozenset(_resolve(model, name) for name in names)
    try:
        expression = model.get_fence_name_expression()
    except NotImplementedError:
        return None
    read = set() if expression is None else _columns_read(expression)
    if read is None:
        return None
    try:
        return frozenset(_resolve(model, name) for name in read)
    except FieldDoesNotExist:
        return None


@functools.lru_cache(maxsize=256)
def _name_keys(model: type[FencedModel]) -> frozenset[str]:
    """The names and attnames of :func:`_name_fields` (how a change may spell them)."""
    fields = _name_fields(model) or ()
    return frozenset(f.name for f in fields) | frozenset(f.attname for f in fields)


def _refuse_move(model: type[models.Model], lease: Lease, why: str) -> None:
    raise ValueError(
        f"lease for lock {lease.name!r} cannot move rows of {model._meta.label} to another "
        f"lock: {why}"
    )


def _name_after(
    model: type[FencedModel], lease: Lease, assigned: dict[Any, Any], *, written: Iterable[Any],
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
    fields = _name_fields(model)
    if fields is None:
        _refuse_move(model, lease, (
            "distlock cannot tell which columns make its lock names, so it cannot check "
            "that this update keeps them"
        ))
    written = set(written)
    for field, value in assigned.items():
        if not hasattr(value, "resolve_expression"):
            continue
        read = _columns_read(value)
        if read is None:
            _refuse_move(model, lease, (
                f"{field.name!r} is set to a subquery or raw SQL; the lock name's fields "
                "take values or expressions over the row's own columns"
            ))
        try:
            others = {_resolve(model, name) for name in read} - {field}
        except FieldDoesNotExist:
            others = set(written)
        if others & written:
            # MariaDB and MySQL evaluate SET left to right: the new name could depend on
            # a column this UPDATE has already changed, unlike in the WHERE.
            _refuse_move(model, lease, (
                f"{field.name!r} is set to an expression over columns this update also "
                "changes"
            ))
    if _uses_template(model) and set(assigned) == fields and not any(
        hasattr(value, "resolve_expression") for value in assigned.values()
    ):
        values = {
            name: assigned[_resolve(model, name)]
            for _, name in parse_fence_name(model.fence_name) if name is not None
        }
        new = model.fence_name.format(**values)  # type: ignore[union-attr]
        if new != lease.name:
            _refuse_move(model, lease, f"the update would give them lock {new!r}")
        return None
    replacements: dict[Any, Any] = {}
    for field, value in assigned.items():
        if not hasattr(value, "resolve_expression"):
            value = Value(value, output_field=field)
        replacements[F(field.attname)] = replacements[F(field.name)] = value
    expression = model.get_fence_name_expression()
    return Q(_SameName(expression.replace_expressions(replacements), lease.name))


def _constant_name(model: type[FencedModel]) -> str | None:
    template = model.fence_name
    return None if template is None else _constant_template(template)


@functools.lru_cache(maxsize=256)
def _constant_template(template: str) -> str | None:
    parts = parse_fence_name(template)
    return template if all(field is None for _, field in parts) else None


@functools.lru_cache(maxsize=256)
def _local_columns(model: type[models.Model]) -> frozenset[str]:
    """Names and attnames of the model's own table's columns."""
    fields = model._meta.local_concrete_fields
    return frozenset(f.name for f in fields) | frozenset(f.attname for f in fields)


def _refuse_other_lock(model: type[models.Model], lease: Lease, name: str, what: str) -> None:
    raise ValueError(
        f"lease for lock {lease.name!r} cannot fence {what} of {model._meta.label}: "
        f"that row is guarded by lock {name!r}"
    )


# -- the transaction around every fenced write -------------------------------------------


def _check_lease(lease: object) -> Lease:
    from distlock.leases import Lease

    if not isinstance(lease, Lease):
        raise TypeError(f"fence must be a distlock Lease, not {type(lease).__name__}")
    return lease


def _share_lock(connection: BaseDatabaseWrapper) -> str:
    # FOR SHARE conflicts with the FOR UPDATE of acquire, renew, release and break, so they
    # wait for the write to commit. SQLite's IMMEDIATE transaction holds the whole file.
    if connection.vendor == "postgresql":
        return " FOR SHARE"
    if connection.vendor == "mysql":
        return " LOCK IN SHARE MODE"
    return ""


def owner_check_sql(connection: BaseDatabaseWrapper) -> str:
    """The locking read that proves, inside the writing transaction, the lease is current."""
    return (
        f"SELECT 1 FROM {LOCK_TABLE} WHERE name = %s AND owner = %s AND token = %s "
        f"AND expires_us > {db.now_sql(connection)}{_share_lock(connection)}"
    )


def _owner_check(connection: BaseDatabaseWrapper, lease: Lease) -> None:
    with connection.cursor() as cursor:
        cursor.execute(owner_check_sql(connection), [lease.name, lease.owner, lease.token])
        if cursor.fetchone() is None:
            raise _Refused(by_owner_check=True)


class _LeaseHolds(Expression):
    """The ownership check inside the write's own statement (PostgreSQL only).

    ``(SELECT distlock_holds(name, owner, token))`` — migration 0002's function, the same
    locking read as :func:`owner_check_sql`. Uncorrelated, so PostgreSQL evaluates it once
    per statement (an InitPlan) before the first row is written; its FOR SHARE row lock
    lasts until the statement's transaction ends, and a lock row changed meanwhile is
    re-checked in its latest version.
    """

    conditional = True
    output_field = models.BooleanField()

    def __init__(self, name: str, owner: str, token: int) -> None:
        super().__init__()
        self.params = [name, owner, token]

    def as_sql(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra: Any
    ) -> tuple[str, list[Any]]:
        return "(SELECT distlock_holds(%s, %s, %s::bigint))", list(self.params)


def _folded_check(model: type[FencedModel], lease: Lease, using: str) -> _LeaseHolds | None:
    """The ownership check as a WHERE condition, when the write can carry it; else None.

    Only on PostgreSQL (MariaDB cannot lock rows in an UPDATE's subquery the same way,
    SQLite's write lock already covers the transaction) and only in autocommit: inside
    the caller's ``atomic()`` the savepoint path keeps everything the save does, signal
    receivers included, inside the fenced write.
    """
    connection = connections[using]
    if (
        connection.vendor != "postgresql"
        or not connection.get_autocommit()
        or not (model.fence_check_ownership and db.same_database(using, lease.using))
    ):
        return None
    return _LeaseHolds(lease.name, lease.owner, lease.token)


def _pinned(query: Any) -> list[tuple[Any, Any]]:
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


def _lease_is_current(lease: Lease, using: str) -> bool:
    """After a folded write matched nothing: did the ownership check fail? (message only)"""
    connection = connections[using]
    with connection.cursor() as cursor:
        return db.holds(connection, cursor, lease.name, lease.owner, lease.token)


def _current_grant(lease: Lease) -> str:
    """A few words on who holds the lock now, for the StaleToken message."""
    row = (
        apps.get_model("distlock", "Lock").objects.using(lease.using).filter(name=lease.name)
        .values_list("token", "owner").first()
    )
    if row is None:
        return "the lock row no longer exists"
    token, owner = row
    if token != lease.token:
        return f"the lock was granted again since (current token {token})"
    if owner != lease.owner:
        return "the lease was released or broken"
    return "the lease expired by the database clock"


def _fenced(
    model: type[FencedModel], lease: Lease, using: str,
    write: Callable[[_LeaseHolds | None], T],
    row_token: Callable[[], int | None], what: str, *, one_statement: bool = False,
) -> T:
    """Run ``write(folded)`` under the ownership check and report a refusal.

    A ``one_statement`` write is handed the check as a condition (``folded``) to put in
    its own statement's WHERE where :func:`_folded_check` allows; otherwise it runs in a
    transaction on ``using`` after a separate locking read, with ``folded=None``.
    ``write`` raises _Refused when its conditional statement matched nothing; nothing is
    kept, then the refusal is reported (``row_token()`` reads the row's token for the
    message only: the decision was the database's).
    """
    folded = _folded_check(model, lease, using) if one_statement else None
    checked = folded is None and model.fence_check_ownership and db.same_database(
        using, lease.using
    )
    # The check's row lock outlives this call when the caller's transaction goes on.
    outlives = checked and db.in_transaction(connections[using])
    try:
        if folded is not None:
            return write(folded)
        db.join_manual_transaction(connections[using])
        try:
            with transaction.atomic(using=using):
                if checked:
                    _owner_check(connections[using], lease)
                return write(None)
        finally:
            if outlives:
                uncommitted.remember(lease.name, using)
    except _Refused as refused:
        token = row_token()
        if not refused.by_owner_check and token is not None and token <= lease.token:
            # The token would have passed: the row's lock name (as stored) did not.
            raise ValueError(
                f"lease for lock {lease.name!r} cannot fence {what}: the row as stored is "
                "guarded by another lock (moving a row to another lock's name is refused)"
            ) from None
        if refused.by_owner_check:
            why = _current_grant(lease)
        elif token is None:
            why = "the row no longer exists"
        else:
            why = "a newer lease has written the row"
        message = (
            f"stale write to {what} refused: lease for lock {lease.name!r} has token "
            f"{lease.token}, the row's token is {'none' if token is None else token}; {why}"
        )
        if refused.by_owner_check or token is not None:
            lease._lose(f"a fenced write was refused: {why}")
        signals.stale_write_refused.send(sender=model, lease=lease, instance_token=token)
        raise StaleToken(message) from None
    except _OtherLock as exc:
        raise ValueError(str(exc)) from None


# -- querysets ----------------------------------------------------------------------------


class FencedQuerySet(models.QuerySet[M]):
    """QuerySet with fenced bulk writes; plain ``update()`` stays unfenced."""

    def update(self, **kwargs: Any) -> int:
        """Plain, unfenced update. Refuses to set ``fence_token``: only fenced writes may."""
        if FENCE_FIELD in kwargs:
            raise ValueError(
                f"{FENCE_FIELD} is written only by fenced writes; use fenced_update(lease, ...)"
            )
        return super().update(**kwargs)

    def bulk_update(self, objs: Iterable[M], fields: Iterable[str], *args: Any, **kwargs: Any,
                    ) -> int:
        """Plain, unfenced bulk_update. Refuses ``fence_token``: only fenced writes set it."""
        fields = list(fields)
        if FENCE_FIELD in fields:
            raise ValueError(f"{FENCE_FIELD} is written only by fenced writes")
        return super().bulk_update(objs, fields, *args, **kwargs)

    def bulk_create(
        self, objs: Iterable[M], batch_size: int | None = None, ignore_conflicts: bool = False,
        update_conflicts: bool = False, update_fields: Iterable[str] | None = None,
        unique_fields: Iterable[str] | None = None,
    ) -> list[M]:
        """Plain, unfenced bulk_create. Refuses ``update_conflicts`` that would write
        ``fence_token`` of existing rows (an upsert is an UPDATE of them)."""
        if update_fields is not None:
            update_fields = list(update_fields)
            if update_conflicts and FENCE_FIELD in update_fields:
                raise ValueError(
                    f"{FENCE_FIELD} is written only by fenced writes; leave it out of "
                    "bulk_create(update_conflicts=True, update_fields=...)"
                )
        return super().bulk_create(
            objs, batch_size=batch_size, ignore_conflicts=ignore_conflicts,
            update_conflicts=update_conflicts, update_fields=update_fields,
            unique_fields=unique_fields,
        )

    def update_or_create(
        self, defaults: Any = None, create_defaults: Any = None, **kwargs: Any,
    ) -> tuple[M, bool]:
        """Plain, unfenced update_or_create. Refuses ``fence_token`` in ``defaults``."""
        if defaults and FENCE_FIELD in defaults:
            raise ValueError(
                f"{FENCE_FIELD} is written only by fenced writes; leave it out of "
                "update_or_create(defaults=...)"
            )
        return super().update_or_create(
            defaults=defaults, create_defaults=create_defaults, **kwargs
        )

    def _fence_target(self, lease: Lease, changes: Iterable[str]) -> _NameTest:
        model = self.model
        local = _local_columns(model)
        for name in (*changes, FENCE_FIELD):
            if name not in local:
                raise ValueError(
                    f"fenced_update() writes one table: {name!r} is not a column of "
                    f"{model._meta.db_table}"
                )
        # Counted on the query as it is (a query that has no table yet reads one).
        if self.query.count_active_tables() > 1:
            # Django would pre-select the ids on MySQL and update them unconditionally.
            raise ValueError(
                "fenced_update() needs a filter on the model's own columns (no joins); "
                "filter by pk__in=... instead"
            )
        constant = _constant_name(model)
        if constant is not None:
            if constant != lease.name:
                _refuse_other_lock(model, lease, constant, "rows")
            return _NameTest(None, None)
        return _name_test(model, lease.name, required=True)

    def fenced_update(self, lease: Lease, **changes: Any) -> int:
        """Update every row of this queryset if ``lease`` may write all of them; the count.

        One conditional UPDATE (``fence_token <= lease.token`` and the row's lock name)
        sets ``fence_token`` to the lease's token, after the ownership check. All or
        nothing: if any row holds a newer token the whole update is rolled back and
        StaleToken is raised; if any row belongs to another lock, or would after the
        update (``changes`` to fields of the lock name: a value is compared before any
        SQL, an expression in the UPDATE's WHERE), ValueError.
        """
        lease = _check_lease(lease)
        if FENCE_FIELD in changes:
            raise ValueError(f"fenced_update() sets {FENCE_FIELD} itself")
        same_name = self._fence_target(lease, changes)
        same_name = same_name._replace(after=self._name_after(lease, changes))

        def write(folded: _LeaseHolds | None) -> int:
            return self._claim(lease, same_name, changes, folded)

        return _fenced(
            self.model, lease, self.db, write, self._row_token, "rows", one_statement=True
        )

    def _name_after(self, lease: Lease, changes: dict[str, Any]) -> Q | None:
        """:func:`_name_after` for ``changes``: None, a WHERE condition, or ValueError."""
        model = self.model
        fields = _name_fields(model)
        if fields is not None and not any(key in _name_keys(model) for key in changes):
            return None  # the common case, without resolving every key
        written = {_resolve(model, key): value for key, value in changes.items()}
        assigned = {
            field: value if hasattr(value, "resolve_expression")
            else _stored_value(model, field, field.name, value)
            for field, value in written.items() if fields is None or field in fields
        }
        return _name_after(
            model, lease, assigned, written=[*written, model._meta.get_field(FENCE_FIELD)]
        )

    def fenced_delete(self, lease: Lease) -> tuple[int, dict[str, int]]:
        """Delete the rows of this queryset if ``lease`` may write all of them.

        The rows are first claimed by a conditional ``fenced_update`` (which locks them),
        then deleted the usual way (cascades and signals), in the same transaction.
        """
        lease = _check_lease(lease)
        same_name = self._fence_target(lease, ())

        def write(folded: _LeaseHolds | None) -> tuple[int, dict[str, int]]:
            self._claim(lease, same_name, {}, folded)
            return models.QuerySet.delete(self.filter(fence_token=lease.token))

        return _fenced(self.model, lease, self.db, write, self._row_token, "rows")

    def _claim(
        self, lease: Lease, same_name: _NameTest, changes: dict[str, Any],
        folded: _LeaseHolds | None,
    ) -> int:
        """The conditional UPDATE of every row (setting ``fence_token``); its count.

        Rows the UPDATE skipped still match this queryset: any of them refuses them all
        (the caller's transaction rolls the update back). With the ownership check
        ``folded`` in, the statement itself also requires that no row would be skipped
        (unless the filter matches one row at most, which is all or nothing by itself),
        so it writes all rows or none and needs no transaction: while it holds the lock
        row's share lock no newer lease can be granted, so none can write meanwhile.
        """
        token = lease.token

        def skipped() -> Q:
            """The rows this queryset matches that the UPDATE would not write."""
            older = Q(fence_token__gt=token)
            if same_name.q is not None:
                older |= ~same_name.q
            if same_name.after is not None:
                older |= ~same_name.after
            return older

        pinned = _pinned(self.query)
        if folded is not None and pinned and same_name.direct:
            # filter(pk=42) with lock "account:42": the name condition is already there.
            column = None if same_name.column in pinned else same_name.column
            rows = _with_fence(self, lease, column, folded)
        else:
            guard = () if folded is None or pinned else (~Exists(self.filter(skipped())),)
            rows = _filter_fence(self, lease, same_name, folded, *guard)
        count = models.QuerySet.update(rows, **changes, fence_token=token)
        if count and folded is not None:
            return int(count)
        if self.filter(skipped()).exists():
            if self.filter(fence_token__gt=token).exists():
                raise _Refused(by_owner_check=False)
            if same_name.after is not None and (
                same_name.q is None or not self.filter(~same_name.q).exists()
            ):
                raise _OtherLock(
                    f"lease for lock {lease.name!r} cannot move rows of "
                    f"{self.model._meta.label} to another lock: after this update some of "
                    "them would be guarded by another lock"
                )
            raise _OtherLock(
                f"lease for lock {lease.name!r} cannot fence every row of this "
                f"queryset: some rows of {self.model._meta.label} are guarded by "
                "another lock"
            )
        if folded is not None and not _lease_is_current(lease, self.db):
            raise _Refused(by_owner_check=True)
        return int(count)

    def _row_token(self) -> int | None:
        top = self.aggregate(top=models.Max(FENCE_FIELD))["top"]
        return None if top is None else int(top)

    def fenced_create(self, lease: Lease, **fields: Any) -> M:
        """Create a row under ``lease`` (ownership check, ``fence_token`` = the token)."""
        obj = self.model(**fields)
        obj.save(fence=lease, force_insert=True, using=self.db)
        return obj


class FencedManager(models.Manager.from_queryset(FencedQuerySet)):  # type: ignore[misc]
    """The default manager of fenced models: ``fenced_update``/``fenced_create`` and co."""


def is_fenced_manager(manager: object) -> bool:
    """True if ``manager``'s querysets are FencedQuerySets (they refuse to set the token)."""
    queryset_class = getattr(manager, "_queryset_class", None)
    return isinstance(queryset_class, type) and issubclass(queryset_class, FencedQuerySet)


def _fenced_base_manager(sender: type[models.Model], **kwargs: Any) -> None:
    """On ``class_prepared``: a FencedModel's ``_base_manager`` is its default manager, when
    that one is fenced and ``Meta.base_manager_name`` names none.

    Django's base manager (related objects, ``refresh_from_db()``, the deletion collector)
    is otherwise a plain Manager, whose ``update(fence_token=0)`` would lower the
    high-water mark. Set here, not in ``FencedModel.Meta``: a child's own ``class Meta``
    does not inherit that option, and as a Meta option it would add a migration to every
    fenced model (migrations read Meta's own attributes, and they leave out a base
    manager that is the default manager).
    """
    opts = sender._meta
    if not issubclass(sender, FencedModel) or opts.abstract or opts.base_manager_name:
        return
    default = opts.default_manager
    if default is not None and is_fenced_manager(default):
        opts.base_manager_name = default.name
        opts.__dict__.pop("base_manager", None)  # a cached_property, maybe computed already


class_prepared.connect(_fenced_base_manager, dispatch_uid="distlock.fenced_base_manager")


# -- the model ----------------------------------------------------------------------------


class FencedModel(models.Model):
    """Abstract model whose rows refuse writes from stale lock holders.

    Declare the lock guarding each row with ``fence_name`` (a ``str.format`` template over
    field names, e.g. ``"account:{pk}"``) or override :meth:`get_fence_name` (and
    :meth:`get_fence_name_expression` for bulk writes). Write with ``save(fence=lease)``,
    ``delete(fence=lease)``, ``objects.filter(...).fenced_update(lease, ...)`` and
    ``objects.fenced_create(lease, ...)``.

    Writes without a fence are allowed (the admin, data migrations, fixtures) and never
    change ``fence_token``, so they cannot lower the high-water mark.
    """

    fence_token = models.BigIntegerField(
        default=0, editable=False,
        help_text="Highest fencing token that has written this row.",
    )

    #: ``str.format`` template over field names (``pk`` works) naming the guarding lock.
    fence_name: ClassVar[str | None] = None
    #: Run the ownership check when the lock table shares the model's database. Turning
    #: it off leaves only the high-water mark (see the README for what that misses).
    fence_check_ownership: ClassVar[bool] = True

    objects = FencedManager()

    class Meta:
        abstract = True

    def get_fence_name(self) -> str:
        """The name of the lock that guards this row (from ``fence_name`` by default)."""
        cls = type(self)
        if cls.fence_name is None:
            raise ImproperlyConfigured(
                f"{cls._meta.label} must set fence_name or override get_fence_name()"
            )
        values = {}
        for _, name in parse_fence_name(cls.fence_name):
            if name is not None:
                field = _resolve(cls, name)
                values[name] = _stored_value(cls, field, name, getattr(self, field.attname))
        return cls.fence_name.format(**values)

    @classmethod
    def get_fence_name_expression(cls) -> Any:
        """SQL expression of each row's lock name, or None if all rows share one name.

        Used by the conditional writes, so a lease can only write rows of its own lock.
        Built from ``fence_name``; override it together with :meth:`get_fence_name`.
        Raises NotImplementedError when there is no template to build it from.
        """
        if cls.fence_name is None:
            raise NotImplementedError(
                f"{cls._meta.label} overrides get_fence_name() without "
                "get_fence_name_expression(), so bulk fenced writes cannot check rows' "
                "lock names in SQL"
            )
        parts: list[Any] = []
        for literal, name in parse_fence_name(cls.fence_name):
            if literal:
                parts.append(Value(literal, output_field=models.TextField()))
            if name is not None:
                field = _resolve(cls, name)
                if _column_type(field) in _TEXT_TYPES:
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

    def _fence_depends_on_missing_pk(self) -> bool:
        cls = type(self)
        if self.pk is not None or cls.fence_name is None:
            return False
        pk = cls._meta.pk
        return any(
            name is not None and _resolve(cls, name) is pk
            for _, name in parse_fence_name(cls.fence_name)
        )

    def _check_fence_name(self, lease: Lease) -> None:
        name = self.get_fence_name()
        if name != lease.name:
            _refuse_other_lock(type(self), lease, name, f"pk={self.pk!r}")

    def save(self, *args: Any, fence: Lease | None = None, **kwargs: Any) -> None:
        """Save; with ``fence=lease`` only if the database agrees the lease is current.

        A new instance (or ``force_insert``) is inserted with ``fence_token`` = the
        lease's token; otherwise one conditional UPDATE writes the row, and matching no
        row raises StaleToken (nothing is written, the lease is marked lost). A lease of
        another lock raises ValueError, as does a write that would leave the row under
        another lock's name (an expression in a field of the name is refused). Without
        ``fence`` this is Django's save, except that ``fence_token`` is never written by an
        UPDATE.
        """
        if fence is None:
            super().save(*args, **kwargs)
            return
        if args:
            raise TypeError("pass save() options as keywords when using fence=")
        lease = _check_lease(fence)
        cls = type(self)
        using = kwargs.get("using") or router.db_for_write(cls, instance=self)
        kwargs["using"] = using
        if kwargs.get("force_insert"):
            adding = True
        elif kwargs.get("force_update") or kwargs.get("update_fields") is not None:
            adding = False
        else:
            adding = self._state.adding
        name_after_insert = self._fence_depends_on_missing_pk()
        if not name_after_insert:
            self._check_fence_name(lease)
        else:
            # The name waits for the new pk; its other fields must already be values.
            pk = cls._meta.pk
            for _, name in parse_fence_name(cls.fence_name):
                if name is not None and (field := _resolve(cls, name)) is not pk:
                    _stored_value(cls, field, name, getattr(self, field.attname))
        if adding:
            kwargs["force_insert"] = True
        elif kwargs.get("update_fields") is None:
            kwargs["force_update"] = True
        old_pk, old_token = self.pk, self.fence_token

        def write(folded: _LeaseHolds | None) -> None:
            self._distlock_fence = (lease, folded)
            if adding:
                self.fence_token = lease.token
            super(FencedModel, self).save(**kwargs)
            if name_after_insert:
                name = self.get_fence_name()
                if name != lease.name:
                    raise _OtherLock(
                        f"lease for lock {lease.name!r} cannot fence the new "
                        f"{cls._meta.label}: it is guarded by lock {name!r}"
                    )

        def row_token() -> int | None:
            if self.pk is None:
                return None
            value = (
                cls._base_manager.using(using).filter(pk=self.pk)
                .values_list(FENCE_FIELD, flat=True).first()
            )
            return None if value is None else int(value)

        # An UPDATE of a table without parent tables is one statement; an INSERT is not
        # (the lock name may need the new pk, and the ownership check must come first).
        one_statement = not adding and not cls._meta.parents
        try:
            _fenced(
                cls, lease, using, write, row_token, f"{cls._meta.label} pk={self.pk!r}",
                one_statement=one_statement,
            )
        except BaseException:
            self.fence_token = old_token
            if adding:
                self.pk = old_pk
                self._state.adding = True
            raise
        finally:
            self.__dict__.pop("_distlock_fence", None)
        self.fence_token = lease.token

    def _do_update(
        self, base_qs: models.QuerySet[Any], using: str, pk_val: Any,
        values: list[Any], update_fields: Any, forced_update: bool, *args: Any, **kwargs: Any,
    ) -> Any:
        # Never write the token from the instance: it may be older than the row's.
        values = [value for value in values if value[0].attname != FENCE_FIELD]
        fence: tuple[Lease, _LeaseHolds | None] | None = self.__dict__.get("_distlock_fence")
        field = self._meta.get_field(FENCE_FIELD)
        owns_column = base_qs.model._meta.concrete_model is field.model._meta.concrete_model
        if fence is None or not owns_column:
            return super()._do_update(  # type: ignore[misc]
                base_qs, using, pk_val, values, update_fields, forced_update, *args, **kwargs
            )
        lease, folded = fence
        cls = type(self)
        same_name = _name_test(cls, lease.name, required=False)
        same_name = same_name._replace(after=self._name_after_save(lease, values, pk_val))
        rows = base_qs
        if folded is not None and same_name.direct:
            # Django filters base_qs by the pk next: one row at most.
            base_qs = _with_fence(base_qs, lease, same_name.column, folded)
        else:
            base_qs = _filter_fence(base_qs, lease, same_name, folded)
        values.append((field, None, lease.token))
        updated = super()._do_update(  # type: ignore[misc]
            base_qs, using, pk_val, values, update_fields, True, *args, **kwargs
        )
        if not updated:
            # Which condition failed only matters for the message and for marking the
            # lease lost; the statement already decided.
            lost = folded is not None and not _lease_is_current(lease, using)
            if not lost and same_name.after is not None and _filter_fence(
                rows.filter(pk=pk_val), lease, same_name._replace(after=None), None
            ).exists():
                raise _OtherLock(
                    f"lease for lock {lease.name!r} cannot save {cls._meta.label} "
                    f"pk={pk_val!r}: with the fields it writes, the row would be guarded "
                    "by another lock"
                )
            raise _Refused(by_owner_check=lost)
        return updated

    def _name_after_save(self, lease: Lease, values: list[Any], pk_val: Any) -> Q | None:
        """:func:`_name_after` for an UPDATE by save(): needed only when it writes some
        fields of the name but not all (``update_fields``, deferred fields), as the name
        then mixes the instance's values and the row's. The pk counts as written: the
        UPDATE's WHERE pins it.
        """
        cls = type(self)
        fields = _name_fields(cls)
        if fields is None:
            return None  # no SQL form: only the instance's name (checked) can be compared
        written = {value[0]: value[2] for value in values}
        if not any(field in fields for field in written):
            return None  # the row keeps its stored name, which the UPDATE's WHERE compares
        written[cls._meta.pk] = pk_val
        of_name = [field for field in written if field in fields]
        if len(of_name) == len(fields):
            return None  # the instance's own name, already compared with the lease's
        assigned = {
            field: _stored_value(cls, field, field.name, written[field]) for field in of_name
        }
        return _name_after(cls, lease, assigned, written=written)

    def delete(
        self, using: str | None = None, keep_parents: bool = False, *,
        fence: Lease | None = None,
    ) -> tuple[int, dict[str, int]]:
        """Delete; with ``fence=lease`` only if the database agrees the lease is current.

        The row is first claimed by a conditional UPDATE of ``fence_token`` (refusals as
        for save), then deleted the usual way, with cascades and signals, in the same
        transaction.
        """
        if fence is None:
            return super().delete(using=using, keep_parents=keep_parents)
        lease = _check_lease(fence)
        cls = type(self)
        using = using or router.db_for_write(cls, instance=self)
        if self.pk is None:
            raise ValueError(f"{cls._meta.label} object can't be deleted: its pk is None")
        self._check_fence_name(lease)
        pk = self.pk

        def write(folded: _LeaseHolds | None) -> tuple[int, dict[str, int]]:
            rows = cls._base_manager.using(using).filter(pk=pk, fence_token__lte=lease.token)
            same_name = _name_test(cls, lease.name, required=False).q
            if same_name is not None:
                rows = rows.filter(same_name)
            if models.QuerySet.update(rows, fence_token=lease.token) == 0:
                raise _Refused(by_owner_check=False)
            return super(FencedModel, self).delete(using=using, keep_parents=keep_parents)

        def row_token() -> int | None:
            value = (
                cls._base_manager.using(using).filter(pk=pk)
                .values_list(FENCE_FIELD, flat=True).first()
            )
            return None if value is None else int(value)

        return _fenced(cls, lease, using, write, row_token, f"{cls._meta.label} pk={pk!r}")
