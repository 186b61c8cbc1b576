"""purge_locks(): deleting lock rows that have been idle for a while, without letting a
name that comes back get a token it already had (the token floor), in short batches."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

from django.db import connections

from distlock import db
from distlock.backends import backend_for
from distlock.constants import PURGE_BATCH
from distlock.core import uncommitted
from distlock.core.batches import in_batches
from distlock.validation import Seconds, check_seconds, check_using


def purge_locks(*, idle: Seconds = timedelta(days=1), using: str | None = None) -> int:
    """Delete lock rows free or expired for at least ``idle``; return how many.

    Fencing tokens stay safe: before each batch's delete the token floor is raised to the
    largest token it may delete (the delete takes only rows at or below it), and new rows
    start above the floor, so a purged name that
    comes back gets a higher token than it ever had. Rows are deleted in batches of
    ``PURGE_BATCH`` names, one short transaction each, so a purge of a large table never
    holds row locks for long; rows that become idle while it runs may be left for the
    next purge. See :func:`purge_batches` for the rest between batches. On SQLite a
    batch polls for the write lock itself and raises OperationalError ("database is
    locked", with the rows deleted before it) if it gets none within the busy timeout
    four times (distlock/core/batches.py); the batches before it stay deleted.
    """
    seconds = check_seconds(idle, "idle")
    if seconds < 0:
        raise ValueError(f"idle must not be negative, not {seconds}")
    alias = check_using(using)
    uncommitted.refuse_if_holding(None, alias, "purging locks")
    return sum(deleted for deleted, _ in purge_batches(alias, round(seconds * 1e6)))


def purge_batches(
    alias: str, idle_us: int, size: int | None = None, rest: float | None = None
) -> Iterator[tuple[int, float]]:
    """purge_locks' batches of ``size`` names (default PURGE_BATCH), one transaction each,
    with a rest after each that deleted rows (distlock/core/batches.py): yields (rows deleted,
    seconds the batch took), for benchmarks/rows_purge.py to time them."""
    size = PURGE_BATCH if size is None else size
    after: str | None = ""
    connection = connections[alias]
    backend = backend_for(connection)
    one_writer = backend.single_writer
    if one_writer:
        db.refuse_atomic(connection, backend)

    def batch() -> tuple[int, bool]:
        # Two transactions: the floor raised (and committed) first, then the delete, so
        # the floor's lock is held for one row's update, not for a batch of deletes
        # (first uses of new names wait for it; docs/performance.md, "Purge beside
        # acquire"). One on SQLite, where every writer waits for the whole batch anyway:
        # the transaction in_batches() opens once it holds the write lock.
        nonlocal after
        if one_writer:
            assert after is not None  # in_batches stops once a batch reached the end
            with connection.cursor() as cursor:
                deleted, after = backend.purge_batch(cursor, idle_us, after, size)
            return deleted, after is not None
        idle, ceiling, after = db.run(alias, "purge_look", idle_us, after, size)
        deleted = db.run(alias, "purge_delete", idle, idle_us, ceiling) if idle else 0
        return deleted, after is not None

    return in_batches(alias, batch, rest)
