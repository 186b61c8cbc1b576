"""SQLite: one writer per file, so the IMMEDIATE transaction is the lock on every row."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends.base import Backend
from distlock.backends.results import FAIL, OK, WARN
from distlock.exceptions import TransactionNotAllowed
from distlock.validation import positive_seconds


class SQLite(Backend):
    vendor = "sqlite"
    # julianday('now') counts whole milliseconds.
    clock_resolution = 0.001
    # No row locks: the IMMEDIATE transaction already holds the write lock (and a fenced
    # write's transaction holds the whole file).
    for_update = ""
    single_writer = True

    def now_sql(self) -> str:
        # julianday('now') has millisecond precision; rounding back to whole milliseconds
        # is exact, so the result is a true epoch millisecond times 1000.
        return "(CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER) * 1000)"

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
