"""SQLite: one writer per file, so the write lock of a statement is the lock on every row.

Grant, renewal and release are one autocommit statement each in the common case — an
``UPDATE … RETURNING`` (SQLite 3.35+) whose write lock is taken when it starts, before
``julianday('now')`` is read — sent through the raw sqlite3 cursor when nothing watches
the connection's queries (:class:`_QmarkCursor`). What needs more than one statement (an
expired lease taken over, a refusal's reason, an old SQLite without RETURNING) runs the
portable steps of :class:`~distlock.backends.base.Backend` in a ``BEGIN IMMEDIATE``
transaction of its own (:meth:`SQLite.immediate`), not through Django's ``atomic()``.
"""

from __future__ import annotations

import contextlib
import functools
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

from django.core.checks import CheckMessage, Error
from django.db import DatabaseError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends.base import Backend
from distlock.backends.lean_cursor import LeanCursor
from distlock.backends.results import FAIL, OK, WARN, Busy, Grant
from distlock.constants import FLOOR_ID, FLOOR_TABLE, MAX_TOKEN, PURGE_POLL
from distlock.constants import LOCK_TABLE as TABLE
from distlock.exceptions import TransactionNotAllowed
from distlock.validation import positive_seconds

T = TypeVar("T")

# julianday('now') has millisecond precision; rounding back to whole milliseconds is
# exact, so the result is a true epoch millisecond times 1000. SQLite reads the clock once
# per statement, at its first use: after the statement's write lock is held.
NOW = "(CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER) * 1000)"

# A free row granted: ``owner = ''`` means nobody's lease is taken over (took_over "").
_GRANT_FREE = (
    f"UPDATE {TABLE} SET token = token + 1, owner = %s, holder = %s, acquired_us = {{now}}, "
    f"renewed_us = NULL, expires_us = {{now}} + %s, renew_count = 0 "
    "WHERE name = %s AND owner = '' AND token < %s RETURNING token, acquired_us, expires_us"
)
# What a refused try reports, read without the write lock: true at the instant of the read.
_PEEK = f"SELECT token, owner, holder, expires_us, {{now}} FROM {TABLE} WHERE name = %s"
# A first use: one above the token floor, read in the same statement (so under its write
# lock). Nothing returned: the row exists, or the floor row is missing, or it is exhausted.
_CREATE = (
    f"INSERT INTO {TABLE} (name, token, owner, holder, acquired_us, renewed_us, expires_us, "
    f"renew_count) SELECT %s, token + 1, %s, %s, {{now}}, NULL, {{now}} + %s, 0 "
    f"FROM {FLOOR_TABLE} WHERE id = %s AND token < %s "
    "ON CONFLICT (name) DO NOTHING RETURNING token, acquired_us, expires_us"
)
_OWNER_CHECK = (
    f"EXISTS (SELECT 1 FROM {TABLE} WHERE name = %s AND owner = %s AND token = %s "
    "AND expires_us > {now})"
)
_RENEW = (
    f"UPDATE {TABLE} SET renewed_us = {{now}}, expires_us = {{now}} + %s, "
    "renew_count = renew_count + 1 "
    f"WHERE name = %s AND owner = %s AND token = %s AND expires_us > {{now}} "
    "RETURNING token, renewed_us, expires_us"
)
# Only an unexpired lease: then "was it still held" is yes without reading the old expiry.
_RELEASE = (
    f"UPDATE {TABLE} SET owner = '', holder = '', expires_us = {{now}} "
    f"WHERE name = %s AND owner = %s AND token = %s AND expires_us > {{now}} "
    "RETURNING expires_us"
)


@functools.lru_cache(maxsize=64)
def _render(template: str, now: str) -> str:
    """A statement above with the clock (``now_sql()``, which tests may pin) put in."""
    return template.replace("{now}", now)


@functools.lru_cache(maxsize=64)
def _qmark(sql: str) -> str:
    # distlock's statements have no literal %: only their placeholders change.
    return sql.replace("%s", "?")


class _QmarkCursor(LeanCursor):
    """The raw sqlite3 cursor, distlock's ``%s`` placeholders turned into its ``?``.

    Django's cursor wrapper rewrites every query's placeholders with a regex; distlock's
    few statements are rewritten once each (``_qmark``, cached).
    """

    def execute(self, sql: str, params: Any = ()) -> None:
        with self.db.wrap_database_errors:
            self.cursor.execute(_qmark(sql), params)


class SQLite(Backend):
    vendor = "sqlite"
    # julianday('now') counts whole milliseconds.
    clock_resolution = 0.001
    # No row locks: the IMMEDIATE transaction already holds the write lock (and a fenced
    # write's transaction holds the whole file).
    for_update = ""
    single_writer = True
    # distlock/backends/indexes.py: steering a planner without statistics.
    grouped_name_sql = "+name"
    common_prefix_sql = ("likelihood(name >= %s, 0.9)", "likelihood(name < %s, 0.9)")
    # UPDATE … RETURNING came with SQLite 3.35; Django supports SQLite from 3.31.
    has_update_returning = sqlite3.sqlite_version_info >= (3, 35)
    #: db.run() calls these in autocommit mode: each is one statement, or opens the
    #: BEGIN IMMEDIATE transaction it needs itself (:meth:`immediate`).
    one_statement: ClassVar[frozenset[str]] = frozenset(
        {"acquire_existing", "acquire_new", "renew", "release", "holds", "expire",
         "semaphore_grant", "rw_grant"}
    )
    # Inside a fenced UPDATE in autocommit: the statement takes the file's write lock when
    # it starts, so nobody can change the lock row before it commits, and its clock is read
    # after that (tests/test_fencing.py).
    @property
    def folded_owner_check_sql(self) -> str:  # type: ignore[override]
        return _render(_OWNER_CHECK, self.now_sql())

    def now_sql(self) -> str:
        return NOW

    def exact_equals_sql(self, sql: str) -> str:
        # A column declared COLLATE NOCASE (ASCII case) or RTRIM (trailing spaces) folds
        # '='; an explicit COLLATE on an operand wins over the column's, the left one first.
        return f"({sql}) COLLATE BINARY = %s"

    def sql(self, template: str) -> str:
        return _render(template, self.now_sql())

    def statement_cursor(self, connection: BaseDatabaseWrapper) -> Any:
        """The lean cursor (:class:`_QmarkCursor`), as :meth:`LeanCursor.reused` gives it.
        (db.run_on() has opened the connection, also one it just closed as broken.)"""
        return _QmarkCursor.reused(connection)

    def busy(self, exc: DatabaseError) -> bool:
        # SQLITE_BUSY and SQLITE_LOCKED, with their extended codes (the low byte).
        code = getattr(exc.__cause__, "sqlite_errorcode", None)
        return code is not None and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)

    def immediate(self, cursor: Any, step: Callable[..., T], *args: Any) -> T:
        """``step(cursor, *args)`` in a ``BEGIN IMMEDIATE`` transaction, committed.

        BEGIN IMMEDIATE takes the file's write lock first (waiting up to the busy
        timeout), so every statement of the step — and its clock — comes after it. Not
        Django's atomic(): db.run() has already refused a caller's transaction, and the
        step is SQL only, so there is nothing for a savepoint to keep.
        """
        cursor.execute("BEGIN IMMEDIATE", ())
        try:
            result = step(cursor, *args)
            cursor.execute("COMMIT", ())
        except BaseException:
            # A failed COMMIT (busy) leaves the transaction open; a failed BEGIN has none.
            with contextlib.suppress(DatabaseError):
                cursor.execute("ROLLBACK", ())
            raise
        return result

    @contextlib.contextmanager
    def batch_transaction(self, connection: BaseDatabaseWrapper) -> Iterator[bool]:
        """Django's durable atomic() on ``connection``, entered once its ``BEGIN
        IMMEDIATE`` has the file's write lock, which this polls for itself: the busy
        timeout set to 0, a try every PURGE_POLL seconds (jittered), for as long as the
        busy timeout would have waited. SQLite's busy handler sleeps ever longer between
        its polls (up to 100 ms), and a writer that commits hundreds of times a second
        takes the lock in every gap, so a purge batch waiting through it starved
        (docs/performance.md, "Purge beside acquire"). Yields whether the lock was taken
        when first asked. Raises the busy error ("database is locked") when the time is
        up, having begun nothing; the busy timeout is put back either way."""
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout")
            timeout_ms = int(cursor.fetchone()[0])
            cursor.execute("PRAGMA busy_timeout = 0")
        with contextlib.ExitStack() as stack:
            try:
                deadline = time.monotonic() + timeout_ms / 1000
                contended = False
                while True:
                    try:
                        stack.enter_context(
                            transaction.atomic(using=connection.alias, durable=True)
                        )
                        break
                    except DatabaseError as exc:
                        if not self.busy(exc) or time.monotonic() >= deadline:
                            raise
                    contended = True
                    # A poll, not a wait for a condition SQLite could signal.
                    time.sleep(random.uniform(0, 2 * PURGE_POLL))
            finally:
                with connection.cursor() as cursor:
                    cursor.execute(f"PRAGMA busy_timeout = {timeout_ms:d}")
            yield contended

    # -- the lock operations: one statement each where SQLite allows -------------------

    def acquire_existing(
        self, cursor: Any, name: str, owner: str, holder: str, ttl_us: int
    ) -> Grant | Busy | None:
        """A free row in one statement; a held one refused from one plain read; an
        expired one taken over (its holder reported) in a transaction."""
        if not self.has_update_returning:
            return self.immediate(cursor, super().acquire_existing, name, owner, holder, ttl_us)
        cursor.execute(self.sql(_GRANT_FREE), [owner, holder, ttl_us, name, MAX_TOKEN])
        row = cursor.fetchone()
        if row is not None:
            return Grant(*row)
        cursor.execute(self.sql(_PEEK), [name])
        row = cursor.fetchone()
        if row is None:
            return None
        token, current_owner, current_holder, expires_us, now_us = row
        if current_owner and expires_us > now_us and token < MAX_TOKEN:
            return Busy(token, current_holder, expires_us - now_us)
        # Expired (a take-over, whose holder is reported), exhausted, or freed since.
        return self.immediate(cursor, super().acquire_existing, name, owner, holder, ttl_us)

    def acquire_new(
        self, cursor: Any, name: str, owner: str, holder: str, ttl_us: int
    ) -> Grant | None:
        """One INSERT … SELECT from the token floor; the portable steps when it inserts
        nothing (the row exists, the floor row is missing, or the tokens ran out)."""
        if self.has_update_returning:
            cursor.execute(self.sql(_CREATE), [name, owner, holder, ttl_us, FLOOR_ID, MAX_TOKEN])
            row = cursor.fetchone()
            if row is not None:
                return Grant(*row)
        return self.immediate(cursor, super().acquire_new, name, owner, holder, ttl_us)

    def renew(
        self, cursor: Any, name: str, owner: str, token: int, ttl_us: int
    ) -> Grant | str:
        """One statement; a refusal's reason from the portable steps (which renew after
        all if the lease was renewed meanwhile by another thread of its holder)."""
        if self.has_update_returning:
            cursor.execute(self.sql(_RENEW), [ttl_us, name, owner, token])
            row = cursor.fetchone()
            if row is not None:
                return Grant(*row)
        return self.immediate(cursor, super().renew, name, owner, token, ttl_us)

    def release(
        self, cursor: Any, name: str, owner: str, token: int
    ) -> tuple[bool, int | None]:
        """One statement for an unexpired lease; otherwise the portable steps (an expired
        lease nobody took over is still cleared, and reported as not held)."""
        if self.has_update_returning:
            cursor.execute(self.sql(_RELEASE), [name, owner, token])
            row = cursor.fetchone()
            if row is not None:
                return True, int(row[0])
        return self.immediate(cursor, super().release, name, owner, token)

    def semaphore_grant(self, cursor: Any, *args: Any) -> Any:
        """The portable steps (shared_rows.py) in a BEGIN IMMEDIATE transaction."""
        return self.immediate(cursor, super().semaphore_grant, *args)

    def rw_grant(self, cursor: Any, *args: Any) -> Any:
        """The portable steps (shared_rows.py) in a BEGIN IMMEDIATE transaction."""
        return self.immediate(cursor, super().rw_grant, *args)

    def join_manual_transaction(self, connection: BaseDatabaseWrapper) -> None:
        """With autocommit off: open the caller's transaction before a savepoint would.

        Python's sqlite3 module begins a transaction only before INSERT/UPDATE/DELETE. A
        SAVEPOINT issued first (by ``atomic()`` around a fenced write) starts a
        transaction of its own, and releasing it *commits* — so a fenced write as the
        first statement after ``set_autocommit(False)`` would be committed however the
        caller ended its transaction. Beginning it here makes the savepoint nest in the
        caller's transaction.
        """
        if (
            connection.connection is not None
            and not connection.autocommit
            and not connection.in_atomic_block
            and not connection.connection.in_transaction
        ):
            mode = getattr(connection, "transaction_mode", None) or "DEFERRED"
            with connection.cursor() as cursor:
                cursor.execute(f"BEGIN {mode}")

    def refuse_shared_writer(
        self, connection: BaseDatabaseWrapper, other: BaseDatabaseWrapper
    ) -> None:
        """SQLite has one writer, so the lock transaction would wait for a transaction on
        another alias of the same file forever (until the busy timeout)."""
        if (
            other.vendor == self.vendor
            and other.settings_dict["NAME"] == connection.settings_dict["NAME"]
        ):
            raise TransactionNotAllowed(
                f"distlock was called inside a transaction on database "
                f"{other.alias!r}, which is the same SQLite file as the lock database "
                f"{connection.alias!r}. SQLite lets one connection write at a time, so the "
                "lock would wait for your transaction to end. Lock outside the transaction."
            )

    def own_connection_advice(self, alias: str) -> str:
        """A second alias does not help here (see :meth:`refuse_shared_writer`)."""
        return (
            "A second alias for the same SQLite file would not help: SQLite lets one "
            "connection write at a time, so a lock taken inside your transaction would "
            "wait for it to end. Take locks outside transactions (or use PostgreSQL or "
            "MariaDB/MySQL, where a second alias works)."
        )

    def independence_warning(self, alias: str, others: list[str]) -> str | None:
        return (
            f"the lock alias {alias!r} is its own connection, but to the same SQLite file "
            f"as {', '.join(map(repr, others))}: SQLite has one writer, so locking inside "
            "atomic() there is still refused"
        )

    def check_messages(
        self, alias: str, settings_dict: dict[str, Any], *, name_collation: str | None = None
    ) -> list[CheckMessage]:
        """distlock.E003 (transaction mode) and E004 (busy timeout)."""
        options = settings_dict.get("OPTIONS", {})
        messages: list[CheckMessage] = []
        if str(options.get("transaction_mode", "")).upper() != "IMMEDIATE":
            messages.append(Error(
                f"SQLite database {alias!r} does not use IMMEDIATE transactions.",
                hint=(
                    'Set DATABASES[...]["OPTIONS"]["transaction_mode"] = "IMMEDIATE". '
                    "A DEFERRED transaction that reads and then writes fails at once with "
                    "'database is locked' instead of waiting for the lock holder."
                ),
                id="distlock.E003",
            ))
        if not positive_seconds(options.get("timeout")):
            messages.append(Error(
                f"SQLite database {alias!r} has no busy timeout.",
                hint='Set DATABASES[...]["OPTIONS"]["timeout"] to seconds to wait, e.g. 20.',
                id="distlock.E004",
            ))
        return messages

    def names_in_code_point_order(self, connection: BaseDatabaseWrapper) -> bool:
        # BINARY, SQLite's default collation, compares the UTF-8 bytes: code point order.
        return True

    def doctor(self, connection: BaseDatabaseWrapper) -> list[tuple[str, str]]:
        options = connection.settings_dict.get("OPTIONS", {})
        found = []
        mode = str(options.get("transaction_mode", "") or "DEFERRED").upper()
        if mode == "IMMEDIATE":
            found.append((OK, "SQLite transaction_mode is IMMEDIATE"))
        else:
            found.append((FAIL, f"SQLite transaction_mode is {mode}: set "
                                "OPTIONS['transaction_mode'] = 'IMMEDIATE', or contending "
                                "lockers fail with 'database is locked' instead of waiting"))
        timeout = options.get("timeout")
        if isinstance(timeout, int | float) and timeout > 0:
            found.append((OK, f"SQLite busy timeout is {timeout} s"))
        else:
            found.append((FAIL, "SQLite has no busy timeout: set OPTIONS['timeout'], e.g. 20"))
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode")
            journal = str(cursor.fetchone()[0]).lower()
        if journal == "wal":
            found.append((OK, "SQLite journal_mode is wal"))
        else:
            found.append((WARN, f"SQLite journal_mode is {journal}: WAL lets readers (the "
                                "admin) run while a lock is being written. Turn it on with "
                                "OPTIONS['init_command'] = 'PRAGMA journal_mode=WAL;' in "
                                "this DATABASES entry (or once: sqlite3 FILE 'PRAGMA "
                                "journal_mode=WAL;' — the file keeps it)"))
        return found


BACKEND = SQLite
