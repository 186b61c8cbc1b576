"""Deleting in batches with a rest between them: purge_locks() and audit retention.

Each batch is one short transaction. After a batch that deleted rows the loop rests as
long as the batch took times ``PURGE_REST``, so the writers waiting for what the batch
held get in before the next: first uses of new names wait for a lock purge's token floor,
and on SQLite every writer waits for the database's one write lock, polling with growing
sleeps, so without the rest it finds the lock taken again by the next batch
(docs/performance.md, "Scale with the data"). The rest is capped (PURGE_REST_MAX): a
batch's time includes its own wait for the lock, and on SQLite, under a stream of writes,
a rest as long as that wait made the purge sixty times slower.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from distlock.constants import PURGE_REST, PURGE_REST_MAX


def in_batches(
    batch: Callable[[], tuple[int, bool]], rest: float | None = None
) -> Iterator[tuple[int, float]]:
    """Run ``batch`` (which returns rows deleted, whether there may be more) until it says
    there is no more; yield (rows deleted, seconds the batch took) after each, resting
    ``rest`` (default PURGE_REST) times the batch's time, at most PURGE_REST_MAX seconds,
    after one that deleted rows."""
    rest = PURGE_REST if rest is None else rest
    more = True
    while more:
        started = time.monotonic()
        deleted, more = batch()
        took = time.monotonic() - started
        yield deleted, took
        if deleted and more and rest > 0:
            # A rest for others, not a wait for a condition.
            time.sleep(min(took * rest, PURGE_REST_MAX))
