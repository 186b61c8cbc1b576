"""The SQL of every lock operation, each one short transaction on the lock's database.

Each operation first takes the lock row with ``SELECT … FOR UPDATE`` (on SQLite the
``BEGIN IMMEDIATE`` write lock plays that part), then decides with a conditional UPDATE
whose time arithmetic reads the database server's real-time clock *after* the row lock is
held. Never PostgreSQL's ``now()`` or Django's ``Now()``: both are frozen before a lock
wait, and a lease computed from them can be expired at birth. No row lock outlives the
operation's transaction, so none is held for the length of a critical section.

Times are integer microseconds since the Unix epoch, by the database clock.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.conf import conf
from distlock.constants import LOCK_TABLE as TABLE
from distlock.constants import MAX_TOKEN
from distlock.exceptions import TokenExhausted, TransactionNotAllowed

# Serialization failures and deadlocks abort the whole transaction: safe to run it again.
RETRIES = 5
_RETRY_SQLSTATES = {"40001", "40P01"}
_RETRY_MYSQL_CODES = {1213, 1020}
# A row-lock wait ended by the session's own limit: PostgreSQL's lock_timeout (55P03
# lock_not_available; distlock never uses NOWAIT, the other source of it) and MariaDB's
# and MySQL's innodb_lock_wait_timeout (1205). See lock_wait_cut_short().
_LOCK_WAIT_SQLSTATES = {"55P03"}
_LOCK_WAIT_MYSQL_CODES = {1205}
# "prepared statement … does not exist" (26000) and "… already exists" (42P05).
_LOST_PREPARED_SQLSTATES = {"26000", "42P05"}
_NEVER_BY_COUNT = 2**62

# The database server's real-time clock, in microseconds since the epoch.
_NOW_US = {
    # clock_timestamp() moves during a transaction; now() is frozen at its start.
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)",
    # SYSDATE() is real time; NOW() is fixed at statement start. UNIX_TIMESTAMP reads its
    # argument in the session time zone, which is also SYSDATE's, so the pair is exact.
    "mysql": "CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED)",
    # julianday('now') has millisecond precision; rounding back to whole milliseconds is
    # exact, so the result is a true epoch millisecond times 1000.
    "sqlite": "(CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER) * 1000)",
}

T = TypeVar("T")


@dataclass(frozen=True)
class Grant:
    """A committed grant or renewal, as the database recorded it."""

    token: int
    acquired_us: int
    expires_us: int
    # The holder whose expired lease this grant took over ("" if the lock was free).
    took_over: str = ""


@dataclass(frozen=True)
class Busy:
    """Someone else holds the lock; ``remaining_us`` is their lease left by the DB clock.

    ``remaining_us`` is None when that is unknown: the wait for the lock row was cut
    short by the session's own timeout (see :func:`lock_wait_cut_short`).
    """

    token: int
    holder: str
    remaining_us: int | None


def now_sql(connection: BaseDatabaseWrapper) -> str:
    """SQL for the database's real-time clock in epoch microseconds."""
    try:
        return _NOW_US[connection.vendor]
    except KeyError:
        raise NotImplementedError(
            f"distlock does not support the {connection.vendor!r} database backend"
        ) from None


def clock_resolution(connection: BaseDatabaseWrapper) -> float:
    """Seconds by which the database clock may lag real time (it truncates).

    SQLite's clock counts whole milliseconds; holders subtract this from their local
    deadline so that it never ends after the database's.
    """
    return 0.001 if connection.vendor == "sqlite" else 0.000001


def _for_update(connection: BaseDatabaseWrapper) -> str:
    # SQLite has no row locks: the IMMEDIATE transaction already holds the write lock.
    return " FOR UPDATE" if connection.features.has_select_for_update else ""


def _has_update_returning(connection: BaseDatabaseWrapper) -> bool:
    # MariaDB and MySQL have no UPDATE … RETURNING.
    return connection.vendor in ("postgresql", "sqlite")


def _retryable(connection: BaseDatabaseWrapper, exc: DatabaseError) -> bool:
    if connection.vendor == "postgresql":
        return getattr(exc.__cause__, "sqlstate", None) in _RETRY_SQLSTATES
    if connection.vendor == "mysql":
        return bool(exc.args) and exc.args[0] in _RETRY_MYSQL_CODES
    return False


def lock_wait_cut_short(connection: BaseDatabaseWrapper, exc: DatabaseError) -> bool:
    """Did a wait for a row lock end because the session's own timeout said so?

    A connection set up with ``lock_timeout`` or ``statement_timeout`` (PostgreSQL) or
    ``innodb_lock_wait_timeout`` (MariaDB/MySQL) gives up waiting for a lock row that
    another transaction holds — an acquire or break in flight, a fenced write's locking
    read. For acquire that only means "busy" (it tries again within its own timeout, or
    returns None), not a database failure. It is safe to try again: PostgreSQL aborted
    the statement (and its transaction); MariaDB rolls back only the statement, but
    run() leaves its atomic block with the error, which rolls back the rest. Nothing
    was written.

    PostgreSQL's statement_timeout cancels with 57014 query_canceled, which is also what
    pg_cancel_backend() and a client's cancel give; only statement_timeout's message is
    taken (in English: with other ``lc_messages`` such a cancel stays an error, as before).
    SQLite has no row locks; its busy timeout ending raises OperationalError as before.
    """
    if connection.vendor == "postgresql":
        cause = exc.__cause__
        sqlstate = getattr(cause, "sqlstate", None)
        if sqlstate in _LOCK_WAIT_SQLSTATES:
            return True
        diag = getattr(cause, "diag", None)
        message = str(getattr(diag, "message_primary", None) or "")
        return sqlstate == "57014" and "statement timeout" in message
    if connection.vendor == "mysql":
        return bool(exc.args) and exc.args[0] in _LOCK_WAIT_MYSQL_CODES
    return False


def one_statement_on(*vendors: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Mark an operation that runs exactly one statement on these database vendors.

    run() executes such an operation in autocommit mode, where the statement is a
    transaction by itself, instead of inside BEGIN … COMMIT. A wrapper around a marked
    operation loses the mark and runs in a transaction again, which is always safe.
    """

    def mark(operation: Callable[..., T]) -> Callable[..., T]:
        operation.one_statement_on = frozenset(vendors)  # type: ignore[attr-defined]
        return operation

    return mark


def in_transaction(connection: BaseDatabaseWrapper) -> bool:
    """True if statements on ``connection`` would join a transaction the caller opened.

    Inside ``atomic()``, and also with autocommit turned off by hand
    (``transaction.set_autocommit(False)``): Django's ``atomic(durable=True)`` then only
    pretends to start a transaction, and what it "commits" stays in the caller's.
    """
    return connection.in_atomic_block or (
        connection.connection is not None and not connection.autocommit
    )


def join_manual_transaction(connection: BaseDatabaseWrapper) -> None:
    """SQLite with autocommit off: open the caller's transaction before a savepoint would.

    Python's sqlite3 module begins a transaction only before INSERT/UPDATE/DELETE. A
    SAVEPOINT issued first (by ``atomic()`` around a fenced write) starts a transaction of
    its own, and releasing it *commits* — so a fenced write as the first statement after
    ``set_autocommit(False)`` would be committed however the caller ended its
    transaction. Beginning it here makes the savepoint nest in the caller's transaction.
    """
    if (
        connection.vendor == "sqlite"
        and connection.connection is not None
        and not connection.autocommit
        and not connection.in_atomic_block
        and not connection.connection.in_transaction
    ):
        mode = getattr(connection, "transaction_mode", None) or "DEFERRED"
        with connection.cursor() as cursor:
            cursor.execute(f"BEGIN {mode}")


def same_database(alias: str, other: str) -> bool:
    """True if two aliases reach the same physical database (so one transaction sees both).

    Compared by ENGINE, NAME, HOST and PORT: two spellings of one server (a socket and
    127.0.0.1) count as different, which only skips the ownership check, never wrongly
    runs it against a database that has no lock table.
    """
    if alias == other:
        return True
    a, b = connections[alias].settings_dict, connections[other].settings_dict
    keys = ("ENGINE", "NAME", "HOST", "PORT")
    return all(str(a.get(key) or "") == str(b.get(key) or "") for key in keys)


def refuse_atomic(connection: BaseDatabaseWrapper) -> None:
    """Raise TransactionNotAllowed if a lock operation on this connection could not commit
    on its own: inside atomic(), or with autocommit off (set_autocommit(False)).

    On SQLite also inside a transaction on another alias of the same file: SQLite has one
    writer, so the lock transaction would wait for the caller's own transaction forever
    (until the busy timeout).
    """
    alias = connection.alias
    if connection.vendor == "sqlite" and not in_transaction(connection):
        for other in connections.all(initialized_only=True):
            if (
                other.alias != alias and other.vendor == "sqlite" and in_transaction(other)
                and other.settings_dict["NAME"] == connection.settings_dict["NAME"]
            ):
                raise TransactionNotAllowed(
                    f"distlock was called inside a transaction on database "
                    f"{other.alias!r}, which is the same SQLite file as the lock database "
                    f"{alias!r}. SQLite lets one connection write at a time, so the lock "
                    "would wait for your transaction to end. Lock outside the transaction."
                )
    # get_autocommit() connects first: a fresh connection is in autocommit mode unless
    # the caller turned it off, and that is what must be known before the first statement.
    if connection.in_atomic_block or not connection.get_autocommit():
        where = (
            "inside transaction.atomic()" if connection.in_atomic_block
            else "with autocommit turned off (transaction.set_autocommit(False))"
        )
        raise TransactionNotAllowed(
            f"distlock was called {where} on database {alias!r}. "
            "A lock grant, renewal or release must commit on its own, before your code goes "
            "on; inside your transaction it would commit or roll back with it (and a "
            "rollback would hand the same fencing token out twice). Call it outside the "
            "transaction, or give distlock its own connection to the same database: "
            f"DATABASES['distlock'] = {{**DATABASES[{alias!r}]}} and "
            "DISTLOCK_DATABASE = 'distlock'."
        )


class _BoundCursor:
    """A psycopg cursor with server-side binding, prepared statements and Django's error
    wrapping.

    Django's own PostgreSQL cursor binds parameters on the client (quoting them into the
    SQL text) and goes through its cursor wrapper; for a lock operation that is one short
    statement this is a measurable part of the cost (see benchmarks/). With
    ``DISTLOCK_PREPARE_STATEMENTS`` (the default) each of distlock's few statements is
    prepared at its first use on a database session, so the server stops parsing and
    planning every call; with it False they are prepared as the connection says
    (``OPTIONS["prepare_threshold"]``; Django's default prepares nothing), which a
    transaction-pooling PgBouncer older than 1.21 needs.
    """

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        import psycopg

        self.connection = connection
        self.raw = connection.connection
        self.cursor = psycopg.Cursor(self.raw)

    def execute(self, sql: str, params: Any = None) -> None:
        with self.connection.wrap_database_errors:
            if not conf.PREPARE_STATEMENTS:
                self.cursor.execute(sql, params)
                return
            try:
                self._execute_prepared(sql, params)
            except Exception as exc:
                if getattr(exc, "sqlstate", None) not in _LOST_PREPARED_SQLSTATES:
                    raise
                # The session lost what psycopg prepared in it (DEALLOCATE ALL or DISCARD
                # ALL behind psycopg's back). psycopg must forget it too, or every later
                # call fails the same way; its clear() also deallocates everything after
                # the next statement, so that one runs unprepared. Running it again is
                # safe: it is its own transaction (autocommit) and failed before it ran.
                self.raw._prepared.clear()
                self.cursor.execute(sql, params, prepare=False)

    def _execute_prepared(self, sql: str, params: Any) -> None:
        # psycopg prepares nothing at all on a connection whose prepare_threshold is None
        # (Django's default), even when asked to. A threshold no query reaches lets it
        # prepare just this one; put back at once, so Django's own queries stay as they
        # were (not counted, never prepared).
        raw = self.raw
        if raw.prepare_threshold is not None:
            self.cursor.execute(sql, params, prepare=True)
            return
        raw.prepare_threshold = _NEVER_BY_COUNT
        try:
            self.cursor.execute(sql, params, prepare=True)
        finally:
            raw.prepare_threshold = None

    def fetchone(self) -> Any:
        with self.connection.wrap_database_errors:
            return self.cursor.fetchone()

    def __enter__(self) -> _BoundCursor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Kept open: the next operation on this connection reuses it (see _statement_cursor).
        pass


@functools.cache
def _is_psycopg3() -> bool:
    # Django also runs on psycopg2: the lean cursor and the wake-ups are psycopg 3's.
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return is_psycopg3


def _statement_cursor(connection: BaseDatabaseWrapper) -> Any:
    """The cursor for a one-statement operation (the connection is open and autocommit).

    The lean cursor only when nobody watches this connection's queries: Django's debug
    query log (DEBUG, assertNumQueries) and execute_wrappers see every statement through
    Django's own cursor, as they would for the ORM.
    """
    if (
        connection.vendor == "postgresql"
        and _is_psycopg3()
        and not connection.queries_logged
        and not connection.execute_wrappers
    ):
        connection.validate_thread_sharing()
        # One cursor per database session, made again after a reconnect: creating a
        # psycopg cursor per statement is a measurable part of an operation's client CPU.
        cursor: _BoundCursor | None = getattr(connection, "_distlock_cursor", None)
        if cursor is None or cursor.raw is not connection.connection:
            cursor = connection._distlock_cursor = _BoundCursor(connection)  # type: ignore[attr-defined]
        return cursor
    return connection.cursor()


def _drop_if_broken(connection: BaseDatabaseWrapper) -> None:
    """Close the connection if an earlier error broke it, so the next statement reconnects.

    Outside the request cycle nobody replaces a connection that broke (a database restart,
    a killed backend). Only a connection that saw an error is checked, and only a broken
    one is closed: Django's close_if_unusable_or_obsolete() would also close a healthy
    connection whenever CONN_MAX_AGE has passed — with the default CONN_MAX_AGE = 0 that is
    every time, a new connection per lock operation (several ms each), and it would drop
    the session of a caller who shares the alias in the middle of its request.
    """
    if connection.connection is not None and connection.errors_occurred:
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            connection.close()


def run(alias: str, operation: Callable[..., T], *args: Any) -> T:
    """Run ``operation(connection, cursor, *args)`` in its own durable transaction.

    Retries the whole transaction on serialization failures and deadlocks, which the
    database resolves by aborting it (REPEATABLE READ on PostgreSQL, gap locks on MariaDB).
    """
    connection = connections[alias]
    refuse_atomic(connection)
    _drop_if_broken(connection)
    # An operation that is one statement on this database is its own transaction in
    # autocommit mode: no BEGIN and COMMIT round trips around it.
    alone = connection.vendor in getattr(operation, "one_statement_on", ()) and (
        connection.get_autocommit()
    )
    attempt = 0
    while True:
        attempt += 1
        try:
            if alone:
                with _statement_cursor(connection) as cursor:
                    return operation(connection, cursor, *args)
            with transaction.atomic(using=alias, durable=True), connection.cursor() as cursor:
                return operation(connection, cursor, *args)
        except DatabaseError as exc:
            if attempt >= RETRIES or not _retryable(connection, exc):
                raise


def _lock_row(connection: BaseDatabaseWrapper, cursor: Any, name: str) -> Any:
    cursor.execute(
        f"SELECT token, owner, holder, expires_us FROM {TABLE} WHERE name = %s"
        + _for_update(connection),
        [name],
    )
    return cursor.fetchone()


def _update_returning(
    connection: BaseDatabaseWrapper, cursor: Any, sql: str, params: list[Any],
    columns: str, name: str,
) -> Any:
    """Run an UPDATE of row ``name``; return ``columns`` of it, or None if it matched nothing.

    The caller holds the row lock, so the follow-up SELECT (where RETURNING is missing)
    reads exactly what the UPDATE wrote.
    """
    if _has_update_returning(connection):
        cursor.execute(f"{sql} RETURNING {columns}", params)
        return cursor.fetchone()
    cursor.execute(sql, params)
    if cursor.rowcount == 0:
        return None
    cursor.execute(f"SELECT {columns} FROM {TABLE} WHERE name = %s", [name])
    return cursor.fetchone()


def _now(connection: BaseDatabaseWrapper, cursor: Any) -> int:
    cursor.execute(f"SELECT {now_sql(connection)}", [])
    return int(cursor.fetchone()[0])


@one_statement_on("postgresql")
def acquire_existing(
    connection: BaseDatabaseWrapper, cursor: Any, name: str, owner: str, holder: str, ttl_us: int
) -> Grant | Busy | None:
    """Take over row ``name`` if it is free or expired. None: the row does not exist yet.

    On PostgreSQL the server-side function ``distlock_acquire`` (migration 0002) does the
    same in one statement, and also creates a missing row (so it never returns None).
    """
    if connection.vendor == "postgresql":
        return _pg_acquire(cursor, name, owner, holder, ttl_us)
    row = _lock_row(connection, cursor, name)
    if row is None:
        return None
    token, current_owner, current_holder, expires_us = row
    if token >= MAX_TOKEN:
        raise TokenExhausted(f"lock {name!r} has used every fencing token up to {MAX_TOKEN}")
    now = now_sql(connection)
    granted = _update_returning(
        connection, cursor,
        f"UPDATE {TABLE} SET token = token + 1, owner = %s, holder = %s, "
        f"acquired_us = {now}, renewed_us = NULL, expires_us = {now} + %s, renew_count = 0 "
        f"WHERE name = %s AND (owner = '' OR expires_us <= {now})",
        [owner, holder, ttl_us, name],
        "token, acquired_us, expires_us", name,
    )
    if granted is not None:
        return Grant(*granted, took_over=current_holder if current_owner else "")
    return Busy(token, current_holder, max(0, expires_us - _now(connection, cursor)))


def _pg_acquire(cursor: Any, name: str, owner: str, holder: str, ttl_us: int) -> Grant | Busy:
    cursor.execute(
        "SELECT status, token, acquired_us, expires_us, other, remaining_us "
        "FROM distlock_acquire(%s, %s, %s, %s::bigint, %s::bigint)",
        [name, owner, holder, ttl_us, MAX_TOKEN],
    )
    status, token, acquired_us, expires_us, other, remaining_us = cursor.fetchone()
    if status == "granted":
        return Grant(token, acquired_us, expires_us, took_over=other)
    if status == "busy":
        return Busy(token, other, remaining_us)
    if status == "exhausted":
        raise TokenExhausted(f"lock {name!r} has used every fencing token up to {MAX_TOKEN}")
    raise TokenExhausted(f"the lock table has used every fencing token up to {MAX_TOKEN}")


def acquire_new(
    connection: BaseDatabaseWrapper, cursor: Any, name: str, owner: str, holder: str, ttl_us: int
) -> Grant | None:
    """Create row ``name`` already granted. None: another process created it first.

    The first token is one above the largest token in the table. Purge never deletes the
    row holding that largest token, so a purged and re-created name still starts above
    every token it was ever given.
    """
    cursor.execute(f"SELECT COALESCE(MAX(token), 0) FROM {TABLE}", [])
    top = int(cursor.fetchone()[0])
    if top >= MAX_TOKEN:
        raise TokenExhausted(f"the lock table has used every fencing token up to {MAX_TOKEN}")
    now = now_sql(connection)
    columns = "(name, token, owner, holder, acquired_us, renewed_us, expires_us, renew_count)"
    values = f"VALUES (%s, %s, %s, %s, {now}, NULL, {now} + %s, 0)"
    if connection.vendor == "mysql":
        # INSERT IGNORE, not "lock if exists else insert": the locking read of a missing
        # key takes a gap lock, and two first users of nearby names then deadlock.
        sql = f"INSERT IGNORE INTO {TABLE} {columns} {values}"
    else:
        sql = f"INSERT INTO {TABLE} {columns} {values} ON CONFLICT (name) DO NOTHING"
    cursor.execute(sql, [name, top + 1, owner, holder, ttl_us])
    if cursor.rowcount != 1:
        return None
    cursor.execute(
        f"SELECT token, acquired_us, expires_us FROM {TABLE} WHERE name = %s", [name]
    )
    return Grant(*cursor.fetchone())


_RENEW_REFUSED = {
    "missing": "the lock row no longer exists",
    "changed": "it was released, broken or taken over",
    "expired": "the lease expired before the renewal reached the database",
}


@one_statement_on("postgresql")
def renew(
    connection: BaseDatabaseWrapper, cursor: Any, name: str, owner: str, token: int, ttl_us: int
) -> Grant | str:
    """Extend the lease of (owner, token). A str says why it cannot be renewed."""
    if connection.vendor == "postgresql":
        cursor.execute(
            "SELECT status, renewed_us, expires_us "
            "FROM distlock_renew(%s, %s, %s::bigint, %s::bigint)",
            [name, owner, token, ttl_us],
        )
        status, renewed_us, expires_us = cursor.fetchone()
        if status != "renewed":
            return _RENEW_REFUSED[status]
        return Grant(token, renewed_us, expires_us)
    row = _lock_row(connection, cursor, name)
    if row is None:
        return _RENEW_REFUSED["missing"]
    if (row[1], row[0]) != (owner, token):
        return _RENEW_REFUSED["changed"]
    now = now_sql(connection)
    renewed = _update_returning(
        connection, cursor,
        f"UPDATE {TABLE} SET renewed_us = {now}, expires_us = {now} + %s, "
        f"renew_count = renew_count + 1 "
        f"WHERE name = %s AND owner = %s AND token = %s AND expires_us > {now}",
        [ttl_us, name, owner, token],
        "token, renewed_us, expires_us", name,
    )
    if renewed is None:
        return _RENEW_REFUSED["expired"]
    return Grant(*renewed)


def _pg_release(
    cursor: Any, name: str, owner: str, token: int, durable: bool
) -> tuple[bool, int | None]:
    cursor.execute(
        "SELECT held, released_us FROM distlock_release(%s, %s, %s::bigint, %s)",
        [name, owner, token, durable],
    )
    held, released_us = cursor.fetchone()
    return bool(held), released_us


@one_statement_on("postgresql")
def release(
    connection: BaseDatabaseWrapper, cursor: Any, name: str, owner: str, token: int
) -> tuple[bool, int | None]:
    """Free the lock if (owner, token) is the current grant.

    Returns (was it still held, the release time by the DB clock). An expired lease that
    nobody took over is cleared as well, but reported as not held.
    """
    if connection.vendor == "postgresql":
        return _pg_release(cursor, name, owner, token, bool(conf.DURABLE_RELEASE))
    row = _lock_row(connection, cursor, name)
    if row is None or (row[1], row[0]) != (owner, token):
        return False, None
    expires_us = row[3]
    released = _update_returning(
        connection, cursor,
        f"UPDATE {TABLE} SET owner = '', holder = '', expires_us = {now_sql(connection)} "
        "WHERE name = %s AND owner = %s AND token = %s",
        [name, owner, token],
        "expires_us", name,
    )
    released_us = int(released[0])
    return expires_us > released_us, released_us


@one_statement_on("postgresql", "mysql", "sqlite")
def holds(
    connection: BaseDatabaseWrapper, cursor: Any, name: str, owner: str, token: int
) -> bool:
    """True if (owner, token) is the current, unexpired grant. A plain read: it takes no
    row lock, so it never waits for a transaction that holds the lock row."""
    cursor.execute(
        f"SELECT 1 FROM {TABLE} WHERE name = %s AND owner = %s AND token = %s "
        f"AND expires_us > {now_sql(connection)}",
        [name, owner, token],
    )
    return cursor.fetchone() is not None


def break_lock(
    connection: BaseDatabaseWrapper, cursor: Any, name: str,
    owner: str | None, token: int | None,
) -> tuple[str, int, str] | None:
    """Free a held lock whoever holds it. Returns the broken (owner, token, holder).

    When ``owner`` or ``token`` is given, only that grant is broken: a lock that changed
    hands since someone looked at it is left alone (None).
    """
    row = _lock_row(connection, cursor, name)
    if row is None or not row[1]:
        return None
    current_token, current_owner, holder, _ = row
    if owner is not None and owner != current_owner:
        return None
    if token is not None and token != current_token:
        return None
    cursor.execute(
        f"UPDATE {TABLE} SET owner = '', holder = '', expires_us = {now_sql(connection)} "
        "WHERE name = %s AND token = %s",
        [name, current_token],
    )
    if connection.vendor == "postgresql":
        cursor.execute("SELECT distlock_wake(%s)", [name])
    return current_owner, current_token, holder


@one_statement_on("postgresql")
def listen(connection: BaseDatabaseWrapper, cursor: Any, name: str) -> None:
    """PostgreSQL: be woken by the next release or break of ``name`` (see wakeups.py)."""
    cursor.execute("SELECT distlock_listen(%s)", [name])
    cursor.fetchone()


@one_statement_on("postgresql")
def unlisten(connection: BaseDatabaseWrapper, cursor: Any, name: str) -> None:
    """PostgreSQL: undo :func:`listen`."""
    cursor.execute("SELECT distlock_unlisten(%s)", [name])
    cursor.fetchone()


def purge(connection: BaseDatabaseWrapper, cursor: Any, idle_us: int) -> int:
    """Delete rows free or expired for at least ``idle_us``; return how many.

    Keeps the row with the largest token: new rows start above it (see acquire_new).
    """
    cursor.execute(f"SELECT COALESCE(MAX(token), 0) FROM {TABLE}", [])
    top = int(cursor.fetchone()[0])
    cursor.execute(
        f"DELETE FROM {TABLE} WHERE token < %s AND expires_us <= {now_sql(connection)} - %s",
        [top, idle_us],
    )
    return int(cursor.rowcount)


def db_now_us(alias: str) -> int:
    """The database server's clock, in epoch microseconds (a plain query, no transaction)."""
    connection = connections[alias]
    with connection.cursor() as cursor:
        return _now(connection, cursor)
