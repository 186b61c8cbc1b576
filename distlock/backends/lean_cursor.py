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
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper


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
        reconnect (creating a driver cursor per statement is itself a measurable cost) —
        or Django's own cursor when something watches the connection's queries: Django's
        debug query log (DEBUG, assertNumQueries) and execute_wrappers see every
        statement through it, as they would for the ORM."""
        if connection.queries_logged or connection.execute_wrappers:
            return connection.cursor()
        connection.validate_thread_sharing()
        cursor: LeanCursor | None = getattr(connection, "_distlock_cursor", None)
        if cursor is None or cursor.raw is not connection.connection or type(cursor) is not cls:
            cursor = connection._distlock_cursor = cls(connection)  # type: ignore[attr-defined]
        return cursor


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
