"""PostgreSQL: server-side lock functions, a lean cursor, LISTEN/NOTIFY wake-ups.

Acquire, renew and release are one statement each: the SQL functions of migration 0002
(``distlock_acquire``, ``distlock_renew``, ``distlock_release``) do the locking read and
the conditional UPDATE on the server, so db.run() sends them in autocommit mode without
BEGIN and COMMIT, as prepared statements sent through libpq (:mod:`~distlock.backends.pg_wire`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, ClassVar

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends import pg_collation
from distlock.backends.base import Backend
from distlock.backends.lean_cursor import LeanCursor
from distlock.backends.pg_wire import WireCursor
from distlock.backends.results import FAIL, OK, RENEW_REFUSED, Busy, Grant, exhausted
from distlock.conf import conf
from distlock.constants import LOCK_TABLE, MAX_TOKEN

# Serialization failures and deadlocks abort the whole transaction: safe to run it again.
_RETRY_SQLSTATES = {"40001", "40P01"}
# A row-lock wait ended by the session's lock_timeout (55P03 lock_not_available;
# distlock never uses NOWAIT, the other source of it).
_LOCK_WAIT_SQLSTATES = {"55P03"}
# A session's transaction status, as libpq reports it: no statement running, none open;
# a statement running.
_IDLE, _ACTIVE = 0, 1

# Every server-side function migration 0002 creates (postgresql_functions.py) and its
# operations call, directly or from another of them: the doctor names any this session
# cannot see.
FUNCTIONS = (
    "distlock_acquire", "distlock_renew", "distlock_release", "distlock_holds",
    "distlock_channel", "distlock_wake", "distlock_listen", "distlock_unlisten",
    "distlock_queue", "distlock_unqueue", "distlock_enqueue", "distlock_follow",
    "distlock_leave", "distlock_ahead",
)
_NO_FUNCTION = (
    "they are created by distlock's migrations in the schema those ran in, and acquire, "
    "renew and release call them. Run `manage.py migrate distlock`; if its migrations are "
    "recorded as applied (run with --fake, or only the tables restored), check that this "
    "connection's search_path (SHOW search_path) includes that schema"
)

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


class _BoundCursor(LeanCursor):
    """A psycopg cursor with server-side binding, prepared as the connection says
    (``OPTIONS["prepare_threshold"]``; Django's default prepares nothing): the lean
    cursor with ``DISTLOCK_PREPARE_STATEMENTS = False``, which a transaction-pooling
    PgBouncer older than 1.21 needs. Django's own PostgreSQL cursor binds parameters on
    the client (quoting them into the SQL text), a measurable part of a short
    statement's cost (see benchmarks/)."""

    def open(self, raw: Any) -> Any:
        import psycopg

        return psycopg.Cursor(raw)


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
        {"acquire_existing", "renew", "release", "holds", "enqueue", "follow", "leave"}
    )
    # distlock_holds() (postgresql_functions.py): the same locking read as owner_check_sql().
    folded_owner_check_sql = "(SELECT distlock_holds(%s, %s, %s::bigint))"
    fence_trigger = True

    def now_sql(self) -> str:
        # clock_timestamp() moves during a transaction; now() is frozen at its start.
        return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"

    false_sql = "FALSE"

    def exact_equals_sql(self, sql: str) -> str:
        # A nondeterministic collation (ICU, ``deterministic = false``) makes '=' fold case,
        # accents or canonical equivalents; "C" compares bytes. On the left operand, after
        # a cast to text: an explicit collation on both sides would be an error ("collation
        # mismatch") and citext's '=' folds case under any collation.
        return f'(({sql})::text COLLATE "C") = %s'

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
        """The lean cursor where psycopg 3 runs, as :meth:`LeanCursor.reused` gives it:
        the wire cursor (:mod:`~distlock.backends.pg_wire`, prepared statements sent
        through libpq) or, with ``DISTLOCK_PREPARE_STATEMENTS = False``,
        :class:`_BoundCursor`."""
        if not is_psycopg3():
            return connection.cursor()
        if conf.PREPARE_STATEMENTS:
            return WireCursor.reused(connection)
        return _BoundCursor.reused(connection)

    def session_started(self, connection: BaseDatabaseWrapper) -> None:
        from distlock.backends import pg_syncrep

        pg_syncrep.watch(connection)

    def follow_timeline(
        self, connection: BaseDatabaseWrapper, margin: int
    ) -> tuple[int, tuple[int, int, int, list[tuple[str, str, int, str]]] | None] | None:
        # Not with autocommit turned off for the whole alias (AUTOCOMMIT = False): the
        # check would open the caller's transaction (docs/deployment.md).
        if connection.connection is None or not connection.autocommit:
            return None
        from distlock.backends import pg_timeline

        return pg_timeline.follow(self, connection.connection, margin)

    def interrupted(self, connection: BaseDatabaseWrapper) -> None:
        """Keep a session the driver has already brought back to idle: on Ctrl-C psycopg
        cancels the statement on the server and reads its end, so nothing of the
        operation is left, and the caller's session settings (a ``SET lock_timeout``, a
        LISTEN) stay. Any other state — a transaction left open, a statement still
        running after an exception psycopg does not catch (a soft time limit) — is
        closed, as on every database; a running statement is cancelled first: a backend
        waiting for a row lock does not see its client go until the wait ends, and would
        then run the operation for nobody."""
        raw = connection.connection
        if raw is not None:
            # psycopg 3's TransactionStatus and psycopg 2's TRANSACTION_STATUS_* agree.
            status = raw.info.transaction_status
            if status == _IDLE:
                return
            if status == _ACTIVE:
                with contextlib.suppress(Exception):
                    raw.cancel()
        super().interrupted(connection)

    # -- wake-ups: LISTEN/NOTIFY (see wakeups.py) ----------------------------------------

    def supports_wakeups(self) -> bool:
        return is_psycopg3()

    def waiting(self, cursor: Any, limit: int) -> list[tuple[str, int, str]] | None:
        """Waiters hold a shared advisory lock (1684825963 or, queued sync waiters,
        1684825969, hashtext(name)) while they wait (``distlock_listen``,
        ``distlock_queue``), so ``pg_locks`` lists them, one row per waiting
        session (a process, or an event loop for all its coroutines). The keys are
        matched to names among the lock rows that are not free, read through the index
        of the owned rows (``owner > ''``, migration 0001), and only when someone waits."""
        cursor.execute(f"SELECT count(*) FROM ({_WAITERS}) AS w")
        if cursor.fetchone()[0] == 0:
            return []
        cursor.execute(_WAITING, [limit])
        return [(name, int(sessions), who) for name, sessions, who in cursor.fetchall()]

    def waiters(self, cursor: Any, name: str) -> int | None:
        """The sessions holding a waiter's advisory lock on ``name``'s key (see
        :meth:`waiting`), each counted once: a queued sync waiter that also listens holds
        both keys. A name whose hashtext() another name shares counts that one's too."""
        cursor.execute(
            f"SELECT count(DISTINCT w.pid) FROM ({_WAITERS}) AS w "
            "WHERE w.key = (hashtext(%s)::bigint & 4294967295)",
            [name],
        )
        return int(cursor.fetchone()[0])

    def enqueue(
        self, cursor: Any, name: str, first: bool, previous: int, listeners: int
    ) -> tuple[int, bool, int, bool]:
        """Join the queue of ``name``'s waiters (``distlock_enqueue``, postgresql_functions.py;
        the first time also the session's "alive" and "queued" advisory locks; a
        ``previous`` entry is given up): the entry's id, which a hand-off names, whether
        the lock looked free (worth a try at once), how many are ahead, and whether this
        waiter listens: fewer than ``listeners`` queued ahead of it, or nobody live."""
        cursor.execute(
            "SELECT queued, free, ahead, head "
            "FROM distlock_enqueue(%s, %s, %s::bigint, %s::integer)",
            [name, first, previous, listeners],
        )
        queued, free, ahead, head = cursor.fetchone()
        return int(queued), bool(free), int(ahead), bool(head)

    def follow(
        self, cursor: Any, name: str, queued: int, wait_ms: int
    ) -> tuple[str, bool, int]:
        """Wait up to ``wait_ms`` behind the live entry ahead of ``queued``, and behind
        the next one when it leaves (``distlock_follow``): "waited" (the time ran out),
        "moved" (one ahead left, and the session's isolation is above READ COMMITTED:
        look again), or, with nobody live ahead, "head" (listening now) or "handed" (its
        row was taken by a hand-off); whether the lock is worth a try at once; and how
        many waiters ahead left while it waited (its wake-ups)."""
        cursor.execute(
            "SELECT status, free, moved FROM distlock_follow(%s, %s::bigint, %s::integer)",
            [name, queued, wait_ms],
        )
        status, free, moved = cursor.fetchone()
        return str(status), bool(free), int(moved)

    def leave(self, cursor: Any, name: str, queued: int) -> None:
        """Leave the queue and free the entry's lock, which wakes the one waiting behind
        it; a reservation for this session that it did not take is handed on to the next
        waiter (``distlock_leave``)."""
        cursor.execute("SELECT distlock_leave(%s, %s::bigint)", [name, queued])
        cursor.fetchone()

    def wait_for_handoff(
        self, connection: BaseDatabaseWrapper, seconds: float, queued: str
    ) -> bool:
        """Wait up to ``seconds`` for the hand-off to queue entry ``queued``: True when it
        came. Others on this session's channel are left-overs of earlier waits (a grant
        taken by polling while the hand-off was on its way): skipped."""
        deadline = time.monotonic() + seconds
        with connection.wrap_database_errors:
            while (left := deadline - time.monotonic()) > 0:
                for notify in connection.connection.notifies(timeout=left, stop_after=1):
                    if notify.payload == queued:
                        return True
        return False

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
        from distlock.backends.pg_pooler import pooler_findings

        missing = self.missing_functions(connection)
        functions = (
            (FAIL, f"function(s) {', '.join(missing)} missing: {_NO_FUNCTION}") if missing
            else (OK, f"distlock's {len(FUNCTIONS)} SQL functions exist")
        )
        return [
            (OK, f"{found}; serialization failures are retried"),
            functions,
            *pooler_findings(connection),
        ]

    def missing_functions(self, connection: BaseDatabaseWrapper) -> list[str]:
        """Which of :data:`FUNCTIONS` no schema on this session's search_path holds."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT DISTINCT p.proname FROM pg_proc p JOIN pg_namespace n "
                "ON n.oid = p.pronamespace WHERE n.nspname = ANY(current_schemas(false)) "
                "AND p.proname = ANY(%s)",
                [list(FUNCTIONS)],
            )
            present = {str(name) for (name,) in cursor.fetchall()}
        return [name for name in FUNCTIONS if name not in present]

    def owned_index_sql(self, create: bool) -> str:
        # CONCURRENTLY: grants and releases go on while a large table is read.
        return super().owned_index_sql(create).replace(" INDEX ", " INDEX CONCURRENTLY ", 1)

    def rare_events_index_sql(self, create: bool) -> str | None:
        # CONCURRENTLY: audit inserts (and so the grants that record them) go on.
        sql = super().rare_events_index_sql(create)
        return None if sql is None else sql.replace(" INDEX ", " INDEX CONCURRENTLY ", 1)

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


# Waiting sessions' advisory locks (distlock_listen's "dlck" and distlock_queue's "dlcq",
# postgresql_functions.py): classid is the first key, objid the second, hashtext(name)
# read as an unsigned 32-bit number.
_WAITERS = (
    "SELECT l.objid::bigint AS key, l.pid FROM pg_locks l WHERE l.locktype = 'advisory' "
    "AND l.classid IN (1684825963, 1684825969) AND l.objsubid = 2 AND l.mode = 'ShareLock' "
    "AND l.granted "
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


BACKEND = PostgreSQL
