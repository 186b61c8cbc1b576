"""The lean cursor: the driver's own cursor, one per database session, with Django's error
wrapping, for the one-statement lock operations (:meth:`Backend.statement_cursor`).

Django's cursor is made anew for every operation and goes through its wrapper layers
(the debug log, execute_wrappers, and on SQLite a regex rewrite of the placeholders);
for an operation that is one short statement that was a measurable part of its client CPU
on every backend (docs/performance.md). What the three backends share is here; each keeps
only its difference in a subclass: PostgreSQL's server-side binding and prepared
statements, MariaDB's extra result sets of a CALL, SQLite's ``?`` placeholders.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

# Django's own logger of SQL statements (what CursorDebugWrapper writes to under DEBUG).
logger = logging.getLogger("django.db.backends")


class LeanCursor:
    """The driver's cursor of one database session, its errors wrapped as Django's.

    ``db`` is the Django connection, named as on Django's own cursor wrapper, so code that
    asks a cursor for its connection (MariaDB's autocommit test) works with both.
    """

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self.db = connection
        self.raw = connection.connection
        self.cursor = self.open(self.raw)

    def open(self, raw: Any) -> Any:
        """The driver's cursor on ``raw``, the DB-API connection."""
        return raw.cursor()

    def execute(self, sql: str, params: Any = None) -> None:
        with self.db.wrap_database_errors:
            self.cursor.execute(sql, params)

    def fetchone(self) -> Any:
        with self.db.wrap_database_errors:
            return self.cursor.fetchone()

    def fetchall(self) -> Any:
        with self.db.wrap_database_errors:
            return self.cursor.fetchall()

    @property
    def rowcount(self) -> int:
        return int(self.cursor.rowcount)

    def __enter__(self) -> LeanCursor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Kept open: the next operation on this connection reuses it (reused()).
        pass

    @classmethod
    def reused(cls, connection: BaseDatabaseWrapper) -> Any:
        """This kind of lean cursor for ``connection``'s session, made again after a
        reconnect (creating a driver cursor per statement is itself a measurable cost).

        When something watches the connection's queries, it still sees every statement:
        execute_wrappers get Django's own cursor (a wrapper may change the statement or
        refuse it, so it must run through them), and Django's debug query log (DEBUG,
        assertNumQueries, CaptureQueriesContext) gets a :class:`LoggedCursor` around the
        lean one. Not Django's debug cursor there: it renders each statement's SQL through
        the driver (psycopg's client-side mogrify), which doubled the client CPU of an
        acquire → release cycle under ``DEBUG = True`` (2.2× the reference instead of
        1.1×; docs/performance.md) — the setting every ``startproject`` begins with.
        """
        if connection.execute_wrappers:
            return connection.cursor()
        connection.validate_thread_sharing()
        cursor: LeanCursor | None = getattr(connection, "_distlock_cursor", None)
        if cursor is None or cursor.raw is not connection.connection or type(cursor) is not cls:
            cursor = connection._distlock_cursor = cls(connection)  # type: ignore[attr-defined]
        if connection.queries_logged:
            return LoggedCursor(cursor)
        return cursor


def sql_literal(value: Any) -> str:
    """``value`` as an SQL literal, for the query log only (never sent to a database)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


class LoggedCursor:
    """A lean cursor whose statements go to Django's query log, as the ORM's do.

    Each statement is appended to ``connection.queries_log`` (what ``connection.queries``,
    ``assertNumQueries`` and ``CaptureQueriesContext`` read) with its parameters written
    in as literals and its duration, and written to the ``django.db.backends`` logger at
    DEBUG level with the same message and ``extra`` as Django's debug cursor — also when
    it fails, as Django's does.
    """

    __slots__ = ("lean",)

    def __init__(self, lean: LeanCursor) -> None:
        self.lean = lean

    def execute(self, sql: str, params: Any = None) -> None:
        began = time.monotonic()
        try:
            self.lean.execute(sql, params)
        finally:
            duration = time.monotonic() - began
            text = sql % tuple(map(sql_literal, params)) if params else sql
            db = self.lean.db
            db.queries_log.append({"sql": text, "time": f"{duration:.3f}"})
            logger.debug(
                "(%.3f) %s; args=%s; alias=%s", duration, text, params, db.alias,
                extra={"duration": duration, "sql": text, "params": params, "alias": db.alias},
            )

    def fetchone(self) -> Any:
        return self.lean.fetchone()

    def fetchall(self) -> Any:
        return self.lean.fetchall()

    @property
    def rowcount(self) -> int:
        return self.lean.rowcount

    def __getattr__(self, name: str) -> Any:
        # What a backend's operation reads of its own kind of lean cursor (MariaDB's
        # result sets of a CALL, the driver's cursor).
        return getattr(self.lean, name)

    def __enter__(self) -> LoggedCursor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def forget(connection: BaseDatabaseWrapper) -> None:
    """Drop ``connection``'s lean cursor, closing the driver's cursor under it: a statement
    it left open (an ``UPDATE … RETURNING`` not read to its end) ends now. Only closing
    the connection is not enough: sqlite3's close() leaves the session alive, its write
    lock held, for as long as a statement of it is (until the cursor is collected)."""
    cursor: LeanCursor | None = connection.__dict__.pop("_distlock_cursor", None)
    if cursor is not None and cursor.cursor is not None:
        with contextlib.suppress(Exception):
            cursor.cursor.close()


class ReadAtOnce(LeanCursor):
    """A lean cursor whose ``execute`` reads the whole answer at once into ``rows`` and
    ``count`` (PostgreSQL's wire cursor, MariaDB's CALLs): what the fetches then return."""

    rows: list[tuple[Any, ...]]
    count: int

    def fetchone(self) -> Any:
        return self.rows.pop(0) if self.rows else None

    def fetchall(self) -> Any:
        rows, self.rows = self.rows, []
        return rows

    @property
    def rowcount(self) -> int:
        return self.count
