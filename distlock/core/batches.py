"""Deleting in batches with a rest between them: purge_locks() and audit retention.

Each batch is one short transaction. After a batch that deleted rows the loop rests as
long as the batch took times ``PURGE_REST``, so the writers waiting for what the batch
held get in before the next: first uses of new names wait for a lock purge's token floor,
and on SQLite every writer waits for the database's one write lock, polling with growing
sleeps, so without the rest it finds the lock taken again by the next batch
(docs/performance.md, "Scale with the data"). The rest is capped (PURGE_REST_MAX): a
batch's time includes its own wait for the lock, and on SQLite, under a stream of writes,
a rest as long as that wait made the purge sixty times slower.

On SQLite (one writer per file) a batch outside the caller's transaction runs in
``backend.batch_transaction``, which polls for the write lock itself, every PURGE_POLL
seconds, instead of through SQLite's busy handler, whose ever longer sleeps lose the lock
to a process that acquires and releases back to back; after a batch that found the lock
taken it rests at least PURGE_BUSY_REST, since each batch delays one operation of every
busy writer. A batch that still gets no lock within the busy timeout fails with
"database is locked" having written nothing, and what it would delete is still there, so
it is run again, at most PURGE_BUSY_RETRIES times: a purge finishes beside a busy site
and still fails, with the error, if another process holds the write lock for minutes.
The batches before it stay done (each is whole on its own); the next purge does the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from django.db import DatabaseError, OperationalError, connections

from distlock.backends import backend_for
from distlock.constants import (
    PURGE_BUSY_REST,
    PURGE_BUSY_RETRIES,
    PURGE_REST,
    PURGE_REST_MAX,
)
from distlock.db import in_transaction

logger = logging.getLogger("distlock")


def in_batches(
    alias: str, batch: Callable[[], tuple[int, bool]], rest: float | None = None
) -> Iterator[tuple[int, float]]:
    """Run ``batch`` (which returns rows deleted, whether there may be more) until it says
    there is no more; yield (rows deleted, seconds the batch took) after each, resting
    ``rest`` (default PURGE_REST) times the batch's time, at most PURGE_REST_MAX seconds,
    after one that deleted rows (at least PURGE_BUSY_REST after one that found SQLite's
    write lock taken). A batch that timed out waiting for database ``alias``'s write lock
    is run again (module docstring); raises OperationalError ("database is locked", the
    rows deleted so far in its message) once it has failed 1 + PURGE_BUSY_RETRIES times."""
    rest = PURGE_REST if rest is None else rest
    more = True
    done = 0
    while more:
        started = time.monotonic()
        deleted, more, contended = _run(alias, batch, done)
        took = time.monotonic() - started
        done += deleted
        yield deleted, took
        if deleted and more and rest > 0:
            # A rest for others, not a wait for a condition.
            pause = min(took * rest, PURGE_REST_MAX)
            time.sleep(max(pause, PURGE_BUSY_REST) if contended else pause)


def _run(
    alias: str, batch: Callable[[], tuple[int, bool]], done: int
) -> tuple[int, bool, bool]:
    """``batch()`` and whether it found the write lock taken; run again after a busy
    timeout up to PURGE_BUSY_RETRIES times. Not in a caller's transaction (atomic(), or
    autocommit turned off): the failed statement has spoilt it, and a retry would run
    outside the writes it was meant to join; nor is the lock polled for there (the
    caller's transaction may hold it)."""
    failures = 0
    while True:
        connection = connections[alias]
        backend = backend_for(connection)
        try:
            if backend.single_writer and not in_transaction(connection):
                with backend.batch_transaction(connection) as contended:
                    deleted, more = batch()
                return deleted, more, contended
            deleted, more = batch()
            return deleted, more, False
        except DatabaseError as exc:
            failures += 1
            if in_transaction(connection) or not backend.busy(exc):
                raise
            if failures > PURGE_BUSY_RETRIES:
                raise OperationalError(
                    f"distlock purge on {alias!r}: {exc} — a batch got no write lock in "
                    f"{failures} tries of the busy timeout each, and wrote nothing; the "
                    f"{done} rows deleted before it stay deleted, the rest is left for "
                    "the next purge"
                ) from exc
            logger.warning("distlock purge: a batch waited out the busy timeout of %r "
                           "(%s); running it again (%d of %d)",
                           alias, exc, failures, PURGE_BUSY_RETRIES)
