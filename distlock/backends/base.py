"""What distlock needs from a database, and the portable SQL that provides most of it.

A :class:`Backend` holds every vendor-specific statement and fact; ``postgresql.py``,
``mysql.py`` and ``sqlite.py`` override what differs from the portable versions here.
The rest of distlock asks ``backend_for(connection)`` and never tests the vendor.

The lock operations (``acquire_existing`` … ``expire``) are run by
:func:`distlock.db.run`, each in one short transaction on the lock's database:
``run(alias, "release", name, owner, token)`` calls ``backend.release(cursor, name,
owner, token)``. Each operation first takes the lock row with ``SELECT … FOR UPDATE`` (on
SQLite the ``BEGIN IMMEDIATE`` write lock plays that part), then decides with a
conditional UPDATE whose time arithmetic reads the database server's real-time clock
*after* the row lock is held. Never PostgreSQL's ``now()`` or Django's ``Now()``: both
are frozen before a lock wait, and a lease computed from them can be expired at birth. No
row lock outlives the operation's transaction, so none is held for the length of a
critical section.

Times are integer microseconds since the Unix epoch, by the database clock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, ClassVar

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends.floor import TokenFloorSQL
from distlock.backends.indexes import IndexSQL
from distlock.backends.lean_cursor import forget as forget_lean_cursor
from distlock.backends.policies import PolicySQL, delay_after_break
from distlock.backends.results import RENEW_REFUSED, Busy, Grant, exhausted
from distlock.backends.shared_rows import SharedRowsSQL
from distlock.backends.site_checks import SchemaChecks
from distlock.backends.waiting import WaitingSQL
from distlock.constants import LOCK_TABLE as TABLE
from distlock.constants import MAX_TOKEN


class Backend(TokenFloorSQL, IndexSQL, WaitingSQL, SharedRowsSQL, SchemaChecks, PolicySQL):
    """One database vendor's SQL and facts. One instance per vendor, shared by threads:
    it keeps no state of its own (per-connection state lives on the connection)."""

    #: ``connection.vendor`` of the databases this backend serves.
    vendor: ClassVar[str] = ""
    #: Seconds by which the database clock may lag real time (it truncates): holders
    #: subtract this from their local deadline so that it never ends after the database's.
    clock_resolution: ClassVar[float] = 0.000001
    #: The clause that makes a SELECT a locking read for writing.
    for_update: ClassVar[str] = " FOR UPDATE"
    #: The clause of the fenced writes' ownership check: it conflicts with the FOR UPDATE
    #: of acquire, renew, release and break, so they wait for the write to commit.
    share_lock: ClassVar[str] = ""
    has_update_returning: ClassVar[bool] = True
    #: Operations that are exactly one statement here: db.run() runs them in autocommit
    #: mode, where the statement is a transaction by itself, without BEGIN and COMMIT
    #: (SQLite's open a BEGIN IMMEDIATE transaction themselves when they need more).
    one_statement: ClassVar[frozenset[str]] = frozenset({"holds"})
    #: The database has one writer at a time (per file), whatever the connection.
    single_writer: ClassVar[bool] = False
    #: The ownership check as a condition a fenced UPDATE can carry in its own WHERE
    #: (params: name, owner, token), where the database can lock the lock row there.
    folded_owner_check_sql: ClassVar[str | None] = None
    #: Whether RefuseLowerFenceToken installs a trigger here (see operations.py).
    fence_trigger: ClassVar[bool] = False

    # -- SQL fragments and facts ---------------------------------------------------------

    def now_sql(self) -> str:
        """SQL for the database's real-time clock in epoch microseconds."""
        raise NotImplementedError

    def insert_if_absent(
        self, table: str, columns: str, values: str, *, key: str = "name"
    ) -> str:
        """An INSERT of one row that does nothing if its primary ``key`` already exists."""
        return f"INSERT INTO {table} {columns} {values} ON CONFLICT ({key}) DO NOTHING"

    def upsert_locking(
        self, table: str, columns: str, values: str, *, key: str, touch: str
    ) -> str:
        """An INSERT of one row that, if its primary ``key`` exists already, changes nothing
        but takes that row's write lock all the same (as ``FOR UPDATE`` would): unlike an
        INSERT that does nothing and a locking read after it, no shared lock is upgraded,
        so first users of one key queue instead of deadlocking."""
        return (
            f"INSERT INTO {table} {columns} {values} "
            f"ON CONFLICT ({key}) DO UPDATE SET {touch} = {table}.{touch}"
        )

    def owner_check_sql(self) -> str:
        """The locking read that proves, inside the writing transaction, the lease is
        current (params: name, owner, token)."""
        return (
            f"SELECT 1 FROM {TABLE} WHERE name = %s AND owner = %s AND token = %s "
            f"AND expires_us > {self.now_sql()}{self.share_lock}"
        )

    def folded_owner_check(self, connection: BaseDatabaseWrapper) -> str | None:
        """``folded_owner_check_sql`` where this server can run it (None: it cannot)."""
        return self.folded_owner_check_sql

    #: SQL's false in a WHERE condition (COALESCE's fallback of the name test).
    false_sql: ClassVar[str] = "0"

    def exact_equals_sql(self, sql: str) -> str:
        """``sql = %s`` compared byte for byte whatever ``sql``'s collation (NULL when
        ``sql`` is NULL). No portable form: SQL's ``=`` follows the column's collation,
        and each vendor names its exact one differently."""
        raise NotImplementedError

    def column_equality_is_safe(self, name: str) -> bool:
        """Whether ``column = %s`` with ``name`` runs on any text column (see
        :meth:`name_equals_sql`); where it could raise an error instead of matching no
        row, the name test is the exact comparison alone."""
        return True

    def name_equals_sql(
        self, sql: str, params: Sequence[Any], name: str, *, column: bool,
    ) -> tuple[str, tuple[Any, ...]]:
        """``<sql> = name``, compared byte for byte under any collation of ``sql``'s
        columns, false (never NULL) when ``sql`` is NULL: (SQL, params).

        A folding collation (NOCASE, RTRIM, MariaDB's ``_ci`` and PAD SPACE ones, a
        PostgreSQL nondeterministic one) makes the column's own ``=`` true for another
        lock's name (``ABC`` for ``abc``), so the comparison that decides is
        :meth:`exact_equals_sql`. When ``sql`` is one ``column``, the column's own ``=``
        goes first as well: the column's index finds the row by it (a COALESCE or a
        changed collation around the column is no index condition), and the exact
        comparison refuses a folded match. ``NULL AND false`` is false, so the pair is
        never NULL either (NOT of it is true for a NULL name, as the refusals need).
        """
        exact = f"COALESCE({self.exact_equals_sql(sql)}, {self.false_sql})"
        if not column or not self.column_equality_is_safe(name):
            return exact, (*params, name)
        return f"({sql} = %s AND {exact})", (*params, name, *params, name)

    def retryable(self, exc: DatabaseError) -> bool:
        """Did the database abort the whole transaction (serialization failure, deadlock),
        so that running it again is safe?"""
        return False

    def busy(self, exc: DatabaseError) -> bool:
        """Did the statement give up waiting for the database's one write lock (SQLite's
        busy timeout), having written nothing? A purge batch is then run again."""
        return False

    def lock_wait_cut_short(self, exc: DatabaseError) -> bool:
        """Did a wait for a row lock end because the session's own timeout said so?

        A connection set up with ``lock_timeout`` or ``statement_timeout`` (PostgreSQL) or
        ``innodb_lock_wait_timeout`` (MariaDB/MySQL) gives up waiting for a lock row that
        another transaction holds — an acquire or break in flight, a fenced write's
        locking read. For acquire that only means "busy" (it tries again within its own
        timeout, or returns None), not a database failure. It is safe to try again:
        nothing was written. SQLite has no row locks; its busy timeout ending raises
        OperationalError as before.
        """
        return False

    def statement_cursor(self, connection: BaseDatabaseWrapper) -> Any:
        """The cursor for a one-statement operation (the connection is open and autocommit)."""
        return connection.cursor()

    # -- a new session (connection_created) --------------------------------------------

    def session_started(self, connection: BaseDatabaseWrapper) -> None:
        """Called for each new session of this database, before its first query: what a
        vendor sets up per session (PostgreSQL: the watch for cancelled synchronous
        replication waits, :mod:`~distlock.backends.pg_syncrep`)."""

    def follow_timeline(
        self, connection: BaseDatabaseWrapper, margin: int
    ) -> tuple[int, tuple[int, int, int, list[tuple[str, str, int, str]]] | None] | None:
        """On a server whose failover epoch changed since the token floor recorded it,
        raise the tokens by ``margin`` and record the new epoch (see
        :mod:`~distlock.backends.pg_timeline`): (the epoch, raise_tokens' result or None
        for a first record), or None when there was nothing to do. Only PostgreSQL has
        such an epoch (its timeline); elsewhere nothing is done."""
        return None

    def interrupted(self, connection: BaseDatabaseWrapper) -> None:
        """An operation was cut short by an exception from outside the database
        (KeyboardInterrupt, a Celery soft time limit, anything a signal handler raises):
        close the connection. :func:`distlock.db.run_on` calls this, and only it, for
        both of its paths, so every vendor and every operation gets the same cleanup.

        Such an exception can land anywhere: between a statement and the reading of its
        answer, or inside Django's ``atomic()`` between its BEGIN and the point where it
        would roll back. What it can leave on the session, by vendor: SQLite's lean
        cursor holding an ``UPDATE … RETURNING`` not read to its end, or a ``BEGIN
        IMMEDIATE`` left open — either keeps the file's one write lock, and every other
        process waited out its busy timeout while this one sat idle (found by
        tests/test_waiting_model.py); MariaDB's CALL with result sets unread, after which
        every statement fails with "commands out of sync" (2014); on any of them an open
        transaction holding row locks. Closing ends all of it, whatever it was, and
        Django opens a new connection for the next query: one rule instead of one
        cleanup per vendor and cursor, at the price of a reconnect after something that
        is rare. Left alone while Django still counts an atomic block open, which only
        its own exit may close (closing then would leave it marked broken for good).
        """
        if not connection.in_atomic_block:
            forget_lean_cursor(connection)
            with contextlib.suppress(Exception):
                connection.close()

    # -- transactions and connections ----------------------------------------------------

    def join_manual_transaction(self, connection: BaseDatabaseWrapper) -> None:
        """With autocommit off: make sure the caller's transaction is open before a
        savepoint would start one of its own (only SQLite needs to)."""

    def refuse_shared_writer(
        self, connection: BaseDatabaseWrapper, other: BaseDatabaseWrapper
    ) -> None:
        """Raise TransactionNotAllowed if ``other``'s open transaction would block every
        write on ``connection`` (``single_writer`` databases only)."""

    def own_connection_advice(self, alias: str) -> str:
        """How to lock while your code is in a transaction on ``alias``, the lock alias
        (distlock_doctor, distlock.W001): give distlock a second alias of its own."""
        return (
            f"Give distlock its own connection: DATABASES['distlock'] = "
            f"{{**DATABASES[{alias!r}], 'ATOMIC_REQUESTS': False}} and "
            "DISTLOCK_DATABASE = 'distlock'."
        )

    def independence_warning(self, alias: str, others: list[str]) -> str | None:
        """distlock_doctor: why the lock alias, its own connection to the database of
        ``others``, still cannot lock inside their transactions (None: it can)."""
        return None

    # -- the lock operations (run by db.run) ---------------------------------------------

    def now(self, cursor: Any) -> int:
        """The database clock, in epoch microseconds."""
        cursor.execute(f"SELECT {self.now_sql()}", [])
        return int(cursor.fetchone()[0])

    def lock_row(self, cursor: Any, name: str) -> Any:
        """(token, owner, holder, expires_us) of row ``name``, locked for writing."""
        cursor.execute(
            f"SELECT token, owner, holder, expires_us FROM {TABLE} WHERE name = %s"
            + self.for_update,
            [name],
        )
        return cursor.fetchone()

    def update_row(
        self, cursor: Any, name: str, changes: str, condition: str, params: list[Any], *,
        returning: str,
    ) -> Any:
        """``UPDATE`` row ``name`` ``SET changes WHERE condition``; return its columns
        ``returning``, or None if the condition did not hold.

        ``{now}`` in ``changes`` and ``condition`` is the database's real-time clock, read
        as the statement runs — after the row lock is held. ``params`` are those of
        ``changes`` then those of ``condition``. The caller holds the row lock, so the
        follow-up SELECT (where RETURNING is missing) reads exactly what the UPDATE wrote.
        """
        now = self.now_sql()
        split = changes.count("%s")
        sql = (
            f"UPDATE {TABLE} SET {changes.replace('{now}', now)} "
            f"WHERE name = %s AND ({condition.replace('{now}', now)})"
        )
        params = [*params[:split], name, *params[split:]]
        if self.has_update_returning:
            cursor.execute(f"{sql} RETURNING {returning}", params)
            return cursor.fetchone()
        cursor.execute(sql, params)
        if cursor.rowcount == 0:
            return None
        cursor.execute(f"SELECT {returning} FROM {TABLE} WHERE name = %s", [name])
        return cursor.fetchone()

    def acquire_existing(
        self, cursor: Any, name: str, owner: str, holder: str, ttl_us: int
    ) -> Grant | Busy | None:
        """Take over row ``name`` if it is free or expired. None: the row does not exist."""
        row = self.lock_row(cursor, name)
        if row is None:
            return None
        token, current_owner, current_holder, expires_us = row
        if token >= MAX_TOKEN:
            raise exhausted(name)
        granted = self.update_row(
            cursor, name,
            "token = token + 1, owner = %s, holder = %s, acquired_us = {now}, "
            "renewed_us = NULL, expires_us = {now} + %s, renew_count = 0",
            "owner = '' OR expires_us <= {now}",
            [owner, holder, ttl_us],
            returning="token, acquired_us, expires_us",
        )
        if granted is not None:
            new_token, acquired_us, new_expires_us = granted
            took_over = current_holder if current_owner else ""
            return Grant(new_token, acquired_us, new_expires_us, took_over=took_over)
        return Busy(token, current_holder, max(0, expires_us - self.now(cursor)))

    def acquire_new(
        self, cursor: Any, name: str, owner: str, holder: str, ttl_us: int
    ) -> Grant | None:
        """Create row ``name`` already granted. None: another process created it first.

        The first token is one above the token floor, which every token purge ever deleted
        is at or below: a name that never had a row may start anywhere, and a purged name
        that comes back starts above every token it ever had. The floor is read under a
        share lock held to the commit. Purge raises it under an exclusive lock, so it
        cannot delete another process's fresh row of this name and raise the floor
        between this read and this insert, which would then give that row's token again.
        """
        top = self.floor(cursor, self.share_lock)
        if top >= MAX_TOKEN:
            raise exhausted()
        now = self.now_sql()
        sql = self.insert_if_absent(
            TABLE,
            "(name, token, owner, holder, acquired_us, renewed_us, expires_us, renew_count)",
            f"VALUES (%s, %s, %s, %s, {now}, NULL, {now} + %s, 0)",
        )
        cursor.execute(sql, [name, top + 1, owner, holder, ttl_us])
        if cursor.rowcount != 1:
            return None
        cursor.execute(
            f"SELECT token, acquired_us, expires_us FROM {TABLE} WHERE name = %s", [name]
        )
        return Grant(*cursor.fetchone())

    def renew(
        self, cursor: Any, name: str, owner: str, token: int, ttl_us: int
    ) -> Grant | str:
        """Extend the lease of (owner, token). A str says why it cannot be renewed."""
        row = self.lock_row(cursor, name)
        if row is None:
            return RENEW_REFUSED["missing"]
        if (row[1], row[0]) != (owner, token):
            return RENEW_REFUSED["changed"]
        renewed = self.update_row(
            cursor, name,
            "renewed_us = {now}, expires_us = {now} + %s, renew_count = renew_count + 1",
            "owner = %s AND token = %s AND expires_us > {now}",
            [ttl_us, owner, token],
            returning="token, renewed_us, expires_us",
        )
        if renewed is None:
            return RENEW_REFUSED["expired"]
        return Grant(*renewed)

    def release(
        self, cursor: Any, name: str, owner: str, token: int
    ) -> tuple[bool, int | None]:
        """Free the lock if (owner, token) is the current grant.

        Returns (was it still held, the release time by the DB clock). An expired lease
        that nobody took over is cleared as well, but reported as not held.
        """
        row = self.lock_row(cursor, name)
        if row is None or (row[1], row[0]) != (owner, token):
            return False, None
        expires_us = row[3]
        released = self.update_row(
            cursor, name, "owner = '', holder = '', expires_us = {now}",
            "owner = %s AND token = %s", [owner, token], returning="expires_us",
        )
        released_us = int(released[0])
        return expires_us > released_us, released_us

    def holds(self, cursor: Any, name: str, owner: str, token: int) -> bool:
        """True if (owner, token) is the current, unexpired grant. A plain read: it takes
        no row lock, so it never waits for a transaction that holds the lock row."""
        cursor.execute(
            f"SELECT 1 FROM {TABLE} WHERE name = %s AND owner = %s AND token = %s "
            f"AND expires_us > {self.now_sql()}",
            [name, owner, token],
        )
        return cursor.fetchone() is not None

    def break_lock(
        self, cursor: Any, name: str, owner: str | None, token: int | None
    ) -> tuple[str, int, str] | None:
        """Free a held lock whoever holds it. Returns the broken (owner, token, holder).

        When ``owner`` or ``token`` is given, only that grant is broken: a lock that
        changed hands since someone looked at it is left alone (None).
        """
        row = self.lock_row(cursor, name)
        if row is None or not row[1]:
            return None
        current_token, current_owner, holder, _ = row
        if owner is not None and owner != current_owner:
            return None
        if token is not None and token != current_token:
            return None
        delay_us = delay_after_break(current_owner, holder)
        if delay_us:
            # A grant made with lock_delay: the name waits that long (backends/policies.py).
            self.break_into_delay(cursor, name, current_token, delay_us)
        else:
            cursor.execute(
                f"UPDATE {TABLE} SET owner = '', holder = '', expires_us = {self.now_sql()} "
                "WHERE name = %s AND token = %s",
                [name, current_token],
            )
        self.broken(cursor, name)
        return current_owner, current_token, holder

    def broken(self, cursor: Any, name: str) -> None:
        """After break_lock freed ``name``, in its transaction: wake whoever waits."""

    def expire(self, cursor: Any, name: str, owner: str, token: int) -> int:
        """End the grant (owner, token) now, as if its ttl had run out (distlock.testing).
        Returns the number of rows changed (0: not the current grant)."""
        cursor.execute(
            f"UPDATE {TABLE} SET expires_us = {self.now_sql()} "
            "WHERE name = %s AND owner = %s AND token = %s",
            [name, owner, token],
        )
        return int(cursor.rowcount)
