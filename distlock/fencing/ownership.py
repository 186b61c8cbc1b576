"""The ownership check of a fenced write, and the transaction every fenced write runs in.

When the lock table shares the model's database, a fenced write proves in its own
transaction that the lease is current: a locking read of the lock row requiring this
lease's owner and token and an expiry later than the database's clock. Its shared row
lock (SQLite: the IMMEDIATE write lock) lasts until the write commits, so a take-over
waits for the commit and a lease that ran out commits nothing. On PostgreSQL and
SQLite and MariaDB in autocommit, the check is folded into the write's own statement
(:class:`LeaseHolds`).

:func:`fenced` runs a write under that check and turns the database's refusal into
StaleToken (or ValueError for a row of another lock).

Every piece of SQL that differs between databases comes from the connection's backend
(:mod:`distlock.backends`): the exact name comparison, the locking read, the folded check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TypeVar

from django.apps import apps
from django.db import DatabaseError, connections, models, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.expressions import Col, Expression
from django.db.models.lookups import Lookup

from distlock import db, signals
from distlock.backends import backend_for, pg_syncrep
from distlock.conf import conf
from distlock.core import uncommitted
from distlock.exceptions import NotReplicated, StaleToken

if TYPE_CHECKING:
    from django.db.models.sql.compiler import SQLCompiler

    from distlock.core.leases import Lease

T = TypeVar("T")


class Refused(Exception):
    """Internal: the database refused the write (raised inside the transaction)."""

    def __init__(self, by_owner_check: bool) -> None:
        super().__init__()
        self.by_owner_check = by_owner_check


class OtherLock(Exception):
    """Internal: a row the write would touch is guarded by another lock."""


def check_lease(lease: object) -> Lease:
    """``lease`` if it is a Lease; TypeError otherwise (a fence must be a real grant)."""
    from distlock.core.leases import Lease

    if not isinstance(lease, Lease):
        raise TypeError(f"fence must be a distlock Lease, not {type(lease).__name__}")
    return lease


class _Condition(Expression):
    """A WHERE condition written in SQL by hand."""

    conditional = True
    output_field = models.BooleanField()


if TYPE_CHECKING:
    _BooleanLookup = Lookup[bool]
else:
    # Django's Lookup is generic only in django-stubs: subscripting it at run time is a
    # TypeError (the test settings' django_stubs_ext made it work there, not for users).
    _BooleanLookup = Lookup


class SameName(_BooleanLookup):
    """``<lock name of the row> = %s``, compared byte for byte under any collation of the
    columns it reads (``Backend.name_equals_sql``), never NULL.

    The column's own ``=`` is no such test: a case-, accent- or pad-folding collation
    makes it true for another lock's name (DESIGN invariant 10). A Lookup (never
    registered on a field) rather than a plain expression: Django compares a conditional
    expression that is not a Lookup with ``= true`` in a MariaDB/MySQL WHERE, which no
    index serves, so the name test's column equality would find no row through the index.
    """

    lookup_name = "distlock_same_name"
    prepare_rhs = False
    can_use_none_as_rhs = False

    def __init__(self, expression: Any, name: str) -> None:
        super().__init__(expression, name)

    @property
    def name(self) -> str:
        """The lock name the rows' names are compared with."""
        return str(self.rhs)

    def as_sql(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper,
    ) -> tuple[str, tuple[Any, ...]]:
        sql, params = compiler.compile(self.lhs)
        return backend_for(connection).name_equals_sql(
            sql, params, self.name, column=isinstance(self.lhs, Col)
        )


class LeaseHolds(_Condition):
    """The ownership check inside the write's own statement, where the backend can do it
    (``Backend.folded_owner_check``; PostgreSQL, SQLite and MariaDB).

    ``(SELECT distlock_holds(name, owner, token))`` — a server-side function doing the
    same locking read as ``Backend.owner_check_sql``. Uncorrelated, so PostgreSQL evaluates it once
    per statement (an InitPlan) before the first row is written; its FOR SHARE row lock
    lasts until the statement's transaction ends, and a lock row changed meanwhile is
    re-checked in its latest version. SQLite: an uncorrelated ``EXISTS (SELECT …)``; the
    UPDATE takes the file's one write lock as it starts, so nobody changes the lock row
    between the check and the commit (tests/test_sqlite_path.py). MariaDB: an uncorrelated
    ``EXISTS (SELECT … LOCK IN SHARE MODE)``, a locking read of the latest committed row
    whatever the isolation level (without the clause, READ COMMITTED would make it a
    snapshot read that takes no lock: tests/test_mysql_procedures.py).
    """

    def __init__(self, name: str, owner: str, token: int) -> None:
        super().__init__()
        self.params = [name, owner, token]

    def as_sql(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra: Any
    ) -> tuple[str, tuple[Any, ...]]:
        sql = backend_for(connection).folded_owner_check(connection)
        assert sql is not None, "folded_check() builds LeaseHolds only where the backend has it"
        return sql, tuple(self.params)


def folded_check(model: type[models.Model], lease: Lease, using: str) -> LeaseHolds | None:
    """The ownership check as a WHERE condition, when the write can carry it; else None.

    Only on PostgreSQL, SQLite and MariaDB (MySQL refuses an UPDATE whose subquery reads
    the table it writes, which the all-or-none condition of a many-row write needs) and
    only in autocommit: inside
    the caller's ``atomic()`` the savepoint path keeps everything the save does, signal
    receivers included, inside the fenced write.
    """
    connection = connections[using]
    if (
        backend_for(connection).folded_owner_check(connection) is None
        or not connection.get_autocommit()
        or not _checks_ownership(model, lease, using)
    ):
        return None
    return LeaseHolds(lease.name, lease.owner, lease.token)


# -- the check and the transaction ------------------------------------------------------


def _checks_ownership(model: type[models.Model], lease: Lease, using: str) -> bool:
    """True if writes of ``model`` on ``using`` check the lease's lock row."""
    return bool(model.fence_check_ownership) and db.same_database(  # type: ignore[attr-defined]
        using, lease.using
    )


def _owner_check(connection: BaseDatabaseWrapper, lease: Lease) -> None:
    with connection.cursor() as cursor:
        sql = backend_for(connection).owner_check_sql()
        cursor.execute(sql, [lease.name, lease.owner, lease.token])
        if cursor.fetchone() is None:
            raise Refused(by_owner_check=True)


def lease_is_current(lease: Lease, using: str) -> bool:
    """After a folded write matched nothing: did the ownership check fail? (message only)"""
    connection = connections[using]
    with connection.cursor() as cursor:
        return bool(backend_for(connection).holds(cursor, lease.name, lease.owner, lease.token))


class Why(NamedTuple):
    """Why a write was refused: ``message`` for StaleToken, ``reason`` for operators (the
    ``stale_write_refused`` signal's ``reason``, which the audit records in the event)."""

    message: str
    reason: str


def current_grant(lease: Lease) -> Why:
    """Who holds the lock now, in a few words, for the StaleToken message and the audit."""
    row = (
        apps.get_model("distlock", "Lock").objects.using(lease.using).filter(name=lease.name)
        .values_list("token", "owner").first()
    )
    if row is None:
        return Why("the lock row no longer exists", "lock row purged")
    token, owner = row
    if token != lease.token:
        return Why(f"the lock was granted again since (current token {token})",
                   f"lock now at token {token}")
    if owner != lease.owner:
        return Why("the lease was released or broken", _freed(lease))
    return Why("the lease expired by the database clock", "lease expired")


def _freed(lease: Lease) -> str:
    """ "lock released" or "lease broken": the lock row looks the same after either; the
    lease knows its own release, and the audit (when on) records a break."""
    if lease._released:
        return "lock released"
    if conf.AUDIT and apps.get_model("distlock", "LockEvent").objects.using(lease.using).filter(
        name=lease.name, token=lease.token, kind="broken",
    ).exists():
        return "lease broken"
    return "lease broken or released elsewhere"


def fenced(
    model: type[models.Model], lease: Lease, using: str,
    write: Callable[[LeaseHolds | None], T],
    row_token: Callable[[], int | None], what: str, *, one_statement: bool = False,
) -> T:
    """Run ``write(folded)`` under the ownership check and report a refusal.

    A ``one_statement`` write is handed the check as a condition (``folded``) to put in
    its own statement's WHERE where :func:`folded_check` allows; otherwise it runs in a
    transaction on ``using`` after a separate locking read, with ``folded=None``.
    ``write`` raises Refused when its conditional statement matched nothing; nothing is
    kept, then the refusal is reported (``row_token()`` reads the row's token for the
    message only: the decision was the database's).
    """
    folded = folded_check(model, lease, using) if one_statement else None
    checked = folded is None and _checks_ownership(model, lease, using)
    connection = connections[using]
    # Committed here, not by the caller's transaction: its commit is checked for a
    # cancelled synchronous replication wait (pg_syncrep); the caller's own is not.
    alone = not db.in_transaction(connection)
    # The check's row lock outlives this call when the caller's transaction goes on.
    outlives = checked and not alone
    if alone:
        pg_syncrep.watching(connection)
    try:
        if folded is not None:
            done = write(folded)
        else:
            backend_for(connection).join_manual_transaction(connection)
            try:
                with transaction.atomic(using=using):
                    if checked:
                        _owner_check(connection, lease)
                    done = write(None)
            finally:
                if outlives:
                    uncommitted.remember(lease.name, using)
    except Refused as refused:
        _report(model, lease, refused, row_token(), what)
    except OtherLock as exc:
        raise ValueError(str(exc)) from None
    except DatabaseError as exc:
        # A terminated backend sends the WARNING, then closes the connection.
        if alone and (warning := pg_syncrep.unreplicated(connection)) is not None:
            raise NotReplicated(f"fenced write to {what} with lock {lease.name!r} token "
                                f"{lease.token}", warning) from exc
        raise
    if alone and (warning := pg_syncrep.unreplicated(connection)) is not None:
        raise NotReplicated(f"fenced write to {what} with lock {lease.name!r} token "
                            f"{lease.token}", warning)
    return done


def _report(
    model: type[models.Model], lease: Lease, refused: Refused, token: int | None, what: str,
) -> NoReturn:
    """Raise what a refused write means: StaleToken (the lease is marked lost and
    ``stale_write_refused`` is sent), or ValueError for a row of another lock."""
    if not refused.by_owner_check and token is not None and token <= lease.token:
        # The token would have passed: the row's lock name (as stored) did not.
        raise ValueError(
            f"lease for lock {lease.name!r} cannot fence {what}: the row as stored is "
            "guarded by another lock (moving a row to another lock's name is refused)"
        ) from None
    if refused.by_owner_check:
        why, reason = current_grant(lease)
    elif token is None:
        why = reason = "the row no longer exists"
    else:
        why, reason = "a newer lease has written the row", f"row already written by token {token}"
    message = (
        f"stale write to {what} refused: lease for lock {lease.name!r} has token "
        f"{lease.token}, the row's token is {'none' if token is None else token}; {why}"
    )
    if refused.by_owner_check or token is not None:
        lease._lose(f"a fenced write was refused: {why}")
    signals.stale_write_refused.send(
        sender=model, lease=lease, instance_token=token, reason=reason
    )
    raise StaleToken(message) from None
