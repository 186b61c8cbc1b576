"""Deleting in batches with a rest between them: purge_locks() and audit retention.

Each batch is one short transaction. After a batch that deleted rows the loop rests as
long as the batch took times ``PURGE_REST``, so the writers waiting for what the batch
held get in before the next: first uses of new names wait for a lock purge's token floor,
and on SQLite every writer waits for the database's one write lock, polling with growing
sleeps, so without the rest it finds the lock taken again by the next batch
(docs/performance.md, "Scale with the data"). The rest is capped (PURGE_REST_MAX): a
batch's time includes its own wait for the lock, and on SQLite, under a stream of writes,
a rest as long as that wait made the purge sixty times slower.

On SQLite a batch beside a stream of acquires can still wait out the busy timeout and fail
with "database is locked" (the writers' polling is not fair). A batch writes nothing when
it fails, and what it would delete is still there, so it is run again, at most
PURGE_BUSY_RETRIES times: a purge finishes beside a busy site and still fails, with the
error, if another process holds the write lock for minutes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from django.db import DatabaseError, connections

from distlock.backends import backend_for
from distlock.constants import PURGE_BUSY_RETRIES, PURGE_REST, PURGE_REST_MAX

logger = logging.getLogger("distlock")


def in_batches(
    alias: str, batch: Callable[[], tuple[int, bool]], rest: float | None = None
) -> Iterator[tuple[int, float]]:
    """Run ``batch`` (which returns rows deleted, whether there may be more) until it says
    there is no more; yield (rows deleted, seconds the batch took) after each, resting
    ``rest`` (default PURGE_REST) times the batch's time, at most PURGE_REST_MAX seconds,
    after one that deleted rows. A batch that timed out waiting for database ``alias``'s
    write lock is run again (module docstring)."""
    rest = PURGE_REST if rest is None else rest
    more = True
    while more:
        started = time.monotonic()
        deleted, more = _run(alias, batch)
        took = time.monotonic() - started
        yield deleted, took
        if deleted and more and rest > 0:
            # A rest for others, not a wait for a condition.
            time.sleep(min(took * rest, PURGE_REST_MAX))


def _run(alias: str, batch: Callable[[], tuple[int, bool]]) -> tuple[int, bool]:
    """``batch()``, run again after a busy timeout up to PURGE_BUSY_RETRIES times. Not in
    a caller's transaction: the failed statement has spoilt it, and a retry would run
    outside the writes it was meant to join."""
    failures = 0
    while True:
        try:
            return batch()
        except DatabaseError as exc:
            failures += 1
            connection = connections[alias]
            if (failures > PURGE_BUSY_RETRIES or connection.in_atomic_block
                    or not backend_for(connection).busy(exc)):
                raise
            logger.warning("distlock purge: a batch waited out the busy timeout of %r "
                           "(%s); running it again (%d of %d)",
                           alias, exc, failures, PURGE_BUSY_RETRIES)
