"""PostgreSQL: server-side lock functions, a lean cursor, LISTEN/NOTIFY wake-ups.

Acquire, renew and release are one statement each: the SQL functions of migration 0002
(``distlock_acquire``, ``distlock_renew``, ``distlock_release``) do the locking read and
the conditional UPDATE on the server, so db.run() sends them in autocommit mode without
BEGIN and COMMIT, through a psycopg cursor with server-side binding and prepared
statements (:class:`_BoundCursor`).
"""

from __future__ import annotations

import contextlib
import functools
import secrets
from typing import Any, ClassVar

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends import pg_collation
from distlock.backends.base import Backend
from distlock.backends.results import FAIL, OK, RENEW_REFUSED, WARN, Busy, Grant, exhausted
from distlock.conf import conf
from distlock.constants import LOCK_TABLE, MAX_TOKEN

# Serialization failures and deadlocks abort the whole transaction: safe to run it again.
_RETRY_SQLSTATES = {"40001", "40P01"}
# A row-lock wait ended by the session's lock_timeout (55P03 lock_not_available;
# distlock never uses NOWAIT, the other source of it).
_LOCK_WAIT_SQLSTATES = {"55P03"}
# "prepared statement … does not exist" (26000) and "… already exists" (42P05).
_LOST_PREPARED_SQLSTATES = {"26000", "42P05"}
_NEVER_BY_COUNT = 2**62

FENCE_FUNCTION = "distlock_refuse_lower_fence_token"

_FENCE_FUNCTION_SQL = f"""
CREATE OR REPLACE FUNCTION {FENCE_FUNCTION}() RETURNS trigger AS $$
BEGIN
    -- TG_ARGV[0] is the column name; the trigger's WHEN clause already compared it.
    RAISE EXCEPTION 'distlock: an UPDATE of % would lower %.% from % to %',
        TG_TABLE_NAME, TG_TABLE_NAME, TG_ARGV[0],
        to_jsonb(OLD) ->> TG_ARGV[0], to_jsonb(NEW) ->> TG_ARGV[0]
        USING ERRCODE = 'check_violation';
END
$$ LANGUAGE plpgsql
"""


def fence_trigger_name(table: str) -> str:
    return f"{table}_fence_token_up"[:63]


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
        # Kept open: the next operation on this connection reuses it (statement_cursor).
        pass


@functools.cache
def is_psycopg3() -> bool:
    # Django also runs on psycopg2: the lean cursor and the wake-ups are psycopg 3's.
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return is_psycopg3


class PostgreSQL(Backend):
    vendor = "postgresql"
    # FOR SHARE conflicts with the FOR UPDATE of acquire, renew, release and break.
    share_lock = " FOR SHARE"
    one_statement: ClassVar[frozenset[str]] = frozenset(
        {"acquire_existing", "renew", "release", "holds", "listen", "unlisten"}
    )
    # Migration 0002's distlock_holds(): the same locking read as owner_check_sql().
    folded_owner_check_sql = "(SELECT distlock_holds(%s, %s, %s::bigint))"
    fence_trigger = True

    def now_sql(self) -> str:
        # clock_timestamp() moves during a transaction; now() is frozen at its start.
        return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"

    def name_equals_sql(self, sql: str) -> str:
        return f"COALESCE(({sql}) = %s, FALSE)"

    def retryable(self, exc: DatabaseError) -> bool:
        return getattr(exc.__cause__, "sqlstate", None) in _RETRY_SQLSTATES

    def lock_wait_cut_short(self, exc: DatabaseError) -> bool:
        # PostgreSQL aborted the statement (and its transaction). statement_timeout
        # cancels with 57014 query_canceled, which is also what pg_cancel_backend() and a
        # client's cancel give; only statement_timeout's message is taken (in English:
        # with other ``lc_messages`` such a cancel stays an error, as before).
        cause = exc.__cause__
        sqlstate = getattr(cause, "sqlstate", None)
        if sqlstate in _LOCK_WAIT_SQLSTATES:
            return True
        diag = getattr(cause, "diag", None)
        message = str(getattr(diag, "message_primary", None) or "")
        return sqlstate == "57014" and "statement timeout" in message

    def statement_cursor(self, connection: BaseDatabaseWrapper) -> Any:
        """The lean cursor, but only when nobody watches this connection's queries:
        Django's debug query log (DEBUG, assertNumQueries) and execute_wrappers see every
        statement through Django's own cursor, as they would for the ORM."""
        if connection.queries_logged or connection.execute_wrappers or not is_psycopg3():
            return connection.cursor()
        connection.validate_thread_sharing()
        # One cursor per database session, made again after a reconnect: creating a
        # psycopg cursor per statement is a measurable part of an operation's client CPU.
        cursor: _BoundCursor | None = getattr(connection, "_distlock_cursor", None)
        if cursor is None or cursor.raw is not connection.connection:
            cursor = connection._distlock_cursor = _BoundCursor(connection)  # type: ignore[attr-defined]
        return cursor

    # -- wake-ups: LISTEN/NOTIFY (see wakeups.py) ----------------------------------------

    def supports_wakeups(self) -> bool:
        return is_psycopg3()

    def wait_for_wakeup(self, connection: BaseDatabaseWrapper, seconds: float) -> None:
        # Only this lock's channel is listened to, so any notification is for it.
        with connection.wrap_database_errors:
            for _ in connection.connection.notifies(timeout=seconds, stop_after=1):
                break

    def waiting(self, cursor: Any, limit: int) -> list[tuple[str, int, str]] | None:
        """Waiters hold a shared advisory lock (1684825963, hashtext(name)) while they
        wait (``distlock_listen``), so ``pg_locks`` lists them, one row per waiting
        session (a process, or an event loop for all its coroutines). The keys are
        matched to names among the lock rows that are not free, read through the index
        of the owned rows (``owner > ''``, migration 0005), and only when someone waits."""
        cursor.execute(f"SELECT count(*) FROM ({_WAITERS}) AS w")
        if cursor.fetchone()[0] == 0:
            return []
        cursor.execute(_WAITING, [limit])
        return [(name, int(sessions), who) for name, sessions, who in cursor.fetchall()]

    def listen(self, cursor: Any, name: str) -> None:
        """LISTEN on the lock's channel, and a shared advisory lock that tells releasers
        someone waits (``distlock_listen``)."""
        cursor.execute("SELECT distlock_listen(%s)", [name])
        cursor.fetchone()

    def unlisten(self, cursor: Any, name: str) -> None:
        cursor.execute("SELECT distlock_unlisten(%s)", [name])
        cursor.fetchone()

    def broken(self, cursor: Any, name: str) -> None:
        cursor.execute("SELECT distlock_wake(%s)", [name])

    # -- the lock operations: server-side functions (migration 0002) ---------------------

    def acquire_existing(
        self, cursor: Any, name: str, owner: str, holder: str, ttl_us: int
    ) -> Grant | Busy:
        """``distlock_acquire`` does the portable steps in one statement, and also creates
        a missing row (so it never returns None)."""
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
        raise exhausted(name if status == "exhausted" else None)

    def renew(
        self, cursor: Any, name: str, owner: str, token: int, ttl_us: int
    ) -> Grant | str:
        cursor.execute(
            "SELECT status, renewed_us, expires_us "
            "FROM distlock_renew(%s, %s, %s::bigint, %s::bigint)",
            [name, owner, token, ttl_us],
        )
        status, renewed_us, expires_us = cursor.fetchone()
        if status != "renewed":
            return RENEW_REFUSED[status]
        return Grant(token, renewed_us, expires_us)

    def release(
        self, cursor: Any, name: str, owner: str, token: int
    ) -> tuple[bool, int | None]:
        return release(cursor, name, owner, token, bool(conf.DURABLE_RELEASE))

    # -- checks, the doctor, migrations --------------------------------------------------

    def names_in_code_point_order(self, connection: BaseDatabaseWrapper) -> bool:
        return pg_collation.code_point_order(connection)

    def doctor(self, connection: BaseDatabaseWrapper) -> list[tuple[str, str]]:
        with connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            found = f"session isolation level is {cursor.fetchone()[0]}"
        return [(OK, f"{found}; serialization failures are retried"), *pooler_findings(connection)]

    def owned_index_sql(self, create: bool) -> str:
        # CONCURRENTLY: grants and releases go on while a large table is read.
        return super().owned_index_sql(create).replace(" INDEX ", " INDEX CONCURRENTLY ", 1)

    def install_fence_trigger(self, schema_editor: Any, table: str, column: str) -> None:
        """A trigger that refuses any UPDATE lowering ``column`` (RefuseLowerFenceToken)."""
        quote = schema_editor.quote_name
        trigger = quote(fence_trigger_name(table))
        schema_editor.execute(_FENCE_FUNCTION_SQL, None)  # None: its % are not placeholders
        schema_editor.execute(f"DROP TRIGGER IF EXISTS {trigger} ON {quote(table)}")
        schema_editor.execute(
            f"CREATE TRIGGER {trigger} BEFORE UPDATE OF {quote(column)} "
            f"ON {quote(table)} FOR EACH ROW WHEN (NEW.{quote(column)} < OLD.{quote(column)}) "
            f"EXECUTE FUNCTION {FENCE_FUNCTION}('{column}')"
        )

    def drop_fence_trigger(self, schema_editor: Any, table: str) -> None:
        quote = schema_editor.quote_name
        schema_editor.execute(
            f"DROP TRIGGER IF EXISTS {quote(fence_trigger_name(table))} ON {quote(table)}"
        )


# Waiting sessions' advisory locks (migration 0002's distlock_listen): classid is the
# first key ("dlck"), objid the second, hashtext(name) read as an unsigned 32-bit number.
_WAITERS = (
    "SELECT l.objid::bigint AS key, l.pid FROM pg_locks l WHERE l.locktype = 'advisory' "
    "AND l.classid = 1684825963 AND l.objsubid = 2 AND l.mode = 'ShareLock' AND l.granted "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
_WAITING = (
    f"WITH w AS ({_WAITERS}), k AS (SELECT w.key, count(*) AS sessions, string_agg("
    "coalesce(nullif(a.application_name, ''), host(a.client_addr), 'local') || ' pid ' "
    "|| w.pid, ', ' ORDER BY w.pid) AS who FROM w LEFT JOIN pg_stat_activity a "
    f"ON a.pid = w.pid GROUP BY w.key) SELECT d.name, k.sessions, k.who FROM {LOCK_TABLE} d "
    "JOIN k ON (hashtext(d.name)::bigint & 4294967295) = k.key "
    "WHERE d.owner > '' ORDER BY k.sessions DESC, d.name LIMIT %s"
)


def release(
    cursor: Any, name: str, owner: str, token: int, durable: bool
) -> tuple[bool, int | None]:
    """``distlock_release``; ``durable`` waits for the commit to be flushed."""
    cursor.execute(
        "SELECT held, released_us FROM distlock_release(%s, %s, %s::bigint, %s)",
        [name, owner, token, durable],
    )
    held, released_us = cursor.fetchone()
    return bool(held), released_us


# -- distlock_doctor: is a transaction pooler (PgBouncer) between us and the server? -------

_PID = "SELECT pg_backend_pid()"


def _backend_pid(raw: Any) -> int:
    """The pid of the server backend that ran this statement. Not ``info.backend_pid``:
    that comes from the connection's start-up, where a pooler answers for the server."""
    return int(raw.execute(_PID).fetchone()[0])


def probe_pooler(connection: BaseDatabaseWrapper) -> tuple[str | None, bool | None]:
    """(evidence of transaction pooling or None, whether prepared statements stray).

    Two new connections with the alias's settings, in autocommit, ask for their backend
    pid in turn. Straight to the server (or through a session pooler) each keeps its own
    backend for life; behind a transaction pooler each statement borrows a pooled server
    connection, so one connection's pid changes, or both are served by one backend
    (PgBouncer hands out the most recently used idle server connection first, so with one
    client at a time the second gets the first's). Stateless, so it strands nothing.

    Only when pooled, prepared statements: the first connection prepares one under a
    random name and the second runs it by that name. A pooler that tracks them per client
    (PgBouncer 1.21+ with ``max_prepared_statements``) refuses; one that does not lets the
    second run the first's statement (it is on that server connection), or loses it from
    the first's next transactions: True. It is deallocated again, where it can be reached.
    """
    import psycopg

    params = dict(connection.get_connection_params())
    for key in ("cursor_factory", "context"):  # Django's sync connection's own
        params.pop(key, None)
    with psycopg.connect(autocommit=True, **params) as first, \
            psycopg.connect(autocommit=True, **params) as second:
        evidence = None
        for _ in range(3):
            a1, b, a2 = (_backend_pid(raw) for raw in (first, second, first))
            if a1 != a2:
                evidence = f"one connection's backend pid changed from {a1} to {a2}"
            elif b == a1:
                evidence = f"two connections were served by the same backend (pid {b})"
            if evidence:
                break
        if evidence is None:
            return evidence, None
        name = f"distlock_doctor_{secrets.token_hex(8)}".encode()
        first.pgconn.prepare(name, _PID.encode())
        strays = second.pgconn.exec_prepared(name, None).ntuples == 1 or any(
            first.pgconn.exec_prepared(name, None).ntuples != 1 for _ in range(3)
        )
        for raw in (second, first):
            with contextlib.suppress(psycopg.Error):
                raw.execute(f"DEALLOCATE {name.decode()}")
        return evidence, strays


def pooler_findings(connection: BaseDatabaseWrapper) -> list[tuple[str, str]]:
    """distlock_doctor's lines on connection pooling, with the settings it needs."""
    if not is_psycopg3():
        return [(OK, "psycopg 2: no wake-ups and no prepared statements (nothing a "
                     "transaction pooler could strand); pooling not probed")]
    try:
        evidence, strays = probe_pooler(connection)
    except Exception as exc:  # noqa: BLE001 - the doctor reports, it does not crash
        return [(WARN, f"could not probe for a connection pooler: {exc}")]
    if evidence is None:
        return [(OK, "no transaction pooler: each connection kept its own server session")]
    found = [(OK, f"a transaction pooler (such as PgBouncer with pool_mode = transaction) "
                  f"is between distlock and the server: {evidence}")]
    if conf.WAKEUPS:
        found.append((FAIL, "set DISTLOCK_WAKEUPS = False: a waiting acquire's LISTEN and "
                            "advisory lock would stay on a pooled server connection"))
    else:
        found.append((OK, "DISTLOCK_WAKEUPS is False: waiting acquires poll"))
    if strays and conf.PREPARE_STATEMENTS:
        found.append((FAIL, "set DISTLOCK_PREPARE_STATEMENTS = False: this pooler lets one "
                            "connection's prepared statements reach another (PgBouncer "
                            "before 1.21, or max_prepared_statements = 0)"))
    elif strays:
        found.append((OK, "DISTLOCK_PREPARE_STATEMENTS is False: distlock prepares nothing "
                          "(this pooler does not keep prepared statements per connection)"))
    else:
        found.append((OK, "this pooler keeps prepared statements per connection (as "
                          "PgBouncer 1.21+ with max_prepared_statements > 0 does): "
                          f"DISTLOCK_PREPARE_STATEMENTS = {conf.PREPARE_STATEMENTS} is safe"))
    return found


BACKEND = PostgreSQL
