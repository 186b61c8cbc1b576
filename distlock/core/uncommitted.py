"""Fenced writes still uncommitted in the caller's own transaction, remembered per thread.

A fenced write inside the caller's ``atomic()`` (or with autocommit off) runs its
ownership check there: a shared row lock on the lock row (PostgreSQL ``FOR SHARE``,
MariaDB ``LOCK IN SHARE MODE``) that lasts until the *caller's* transaction ends. That is
the point of the check — a take-over waits for the write's commit — but any lock
operation on that row from the same thread through the lock's own connection (a separate
``DISTLOCK_DATABASE`` alias) would wait for a transaction that cannot end while the thread
waits: a self-deadlock (forever on PostgreSQL, ``innodb_lock_wait_timeout`` on MariaDB).

So the check leaves a note here, and the lock operations read it first:

- ``release()`` is deferred: the lease is released when that transaction ends — at its
  commit (before ``atomic()`` returns), or moments after a rollback (see leases.py);
- ``renew()``, ``break_lock()``, ``purge_locks()`` and acquiring the same name again raise
  :class:`~distlock.exceptions.TransactionNotAllowed` instead of hanging.

A note lasts as long as the transaction it was taken in: inside ``atomic()`` it is tied to
an ``on_commit`` callback (gone at commit, and dropped by Django at a rollback); with
autocommit off by hand it lasts until autocommit is back on, because Django cannot say
when such a transaction ended (the cautious answer: it may still hold the row lock).
SQLite needs none of this: a second connection to the same file is refused inside any
transaction already (db.refuse_atomic).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock import db
from distlock.exceptions import TransactionNotAllowed


@dataclass(eq=False)
class Note:
    """A row lock on lock ``name`` held by the open transaction on ``connection``."""

    name: str
    connection: BaseDatabaseWrapper
    # Registered with on_commit inside atomic(): present in the connection's list exactly
    # while the transaction that took the row lock is open.
    marker: Callable[[], None] | None = field(default=None)

    @property
    def open(self) -> bool:
        """True while the transaction that took the row lock may still be open."""
        connection = self.connection
        if self.marker is not None:
            return connection.in_atomic_block and any(
                entry[1] is self.marker for entry in connection.run_on_commit
            )
        return db.in_transaction(connection)


class _Notes(threading.local):
    def __init__(self) -> None:
        self.notes: list[Note] = []


_local = _Notes()


def remember(name: str, using: str) -> None:
    """Note that the caller's open transaction on ``using`` now holds lock ``name``'s row.

    Call it after the fenced write's own savepoint ended (its callbacks then belong to the
    caller's transaction), whether the write was accepted or refused: a refused check may
    still hold the row (MariaDB keeps the locks of a rolled-back savepoint).
    """
    connection = connections[using]
    note = Note(name, connection)
    if connection.in_atomic_block:

        def marker() -> None:
            _forget(note)

        note.marker = marker
        transaction.on_commit(marker, using=using)
    _local.notes = [n for n in _local.notes if n.open]
    _local.notes.append(note)


def _forget(note: Note) -> None:
    _local.notes = [n for n in _local.notes if n is not note and n.open]


def holding(name: str | None, lock_alias: str) -> list[Note]:
    """This thread's open notes on lock ``name`` (any name if None) in ``lock_alias``'s
    database, whose row locks a statement on ``lock_alias`` would wait for."""
    if not _local.notes:
        return []
    _local.notes = [n for n in _local.notes if n.open]
    return [
        note for note in _local.notes
        if (name is None or note.name == name)
        and note.connection.alias != lock_alias
        and db.same_database(note.connection.alias, lock_alias)
    ]


def refuse_if_holding(name: str | None, lock_alias: str, what: str) -> None:
    """Raise TransactionNotAllowed if ``what`` would wait for this thread's own transaction."""
    notes = holding(name, lock_alias)
    if notes:
        alias = notes[0].connection.alias
        lock = f"lock {notes[0].name!r}"
        raise TransactionNotAllowed(
            f"{what} would wait for your own open transaction on database {alias!r}: a "
            f"fenced write in it holds the row of {lock} until it commits or rolls back. "
            f"Do it before the fenced writes or after the transaction ends (a release in "
            "this window is deferred to the end of the transaction instead)."
        )
