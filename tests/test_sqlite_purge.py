"""A purge on SQLite beside a tight acquire loop in another process (issue 17).

SQLite has one write lock per file, and its busy handler (Python's ``timeout``) polls
for it in growing sleeps (1, 2, 5 … 100 ms): a process that acquires and releases back
to back, hundreds of commits a second, takes the lock in every gap, and a purge batch
waiting through that handler used to wait out the busy timeout again and again
(docs/performance.md, "Purge beside acquire"). A purge batch on SQLite now polls for the
write lock itself, often and briefly (distlock/backends/sqlite.py, ``polled_write``).

These tests start a real second process that cycles locks as fast as it can, and purge
beside it: the purge must finish within a deadline, without a single busy timeout
("running it again"), and delete exactly the idle rows.
"""

from __future__ import annotations

import logging
import select
import sys
import time
from collections.abc import Callable, Iterator

import pytest
from django.db import connection, connections  # noqa: F401  (the skipif condition)

from distlock import acquire, purge_locks
from distlock.models import Lock, LockEvent
from distlock.ops.audit import purge_events

pytestmark = [
    pytest.mark.usefixtures("lock_db"),
    pytest.mark.skipif(
        "connections['default'].vendor != 'sqlite'",
        reason="SQLite's one write lock (distlock/backends/sqlite.py)",
    ),
]

IDLE_ROWS = 20_000
# Unloaded, a purge of IDLE_ROWS takes a fraction of a second, and about 3 s beside the
# loop (21 batches, each followed by PURGE_BUSY_REST).
DEADLINE = 20.0
# The purging connection's busy timeout: through SQLite's busy handler, batches beside the
# loop waited up to 3 s for the write lock (and in the benchmark, past 5 s).
BUSY_TIMEOUT_MS = 1000


def tight_loop(names: list[str]) -> None:
    """The child process: acquire and release ``names`` in turn as fast as it can until a
    line arrives on stdin; says "running" once it has cycled a hundred times, and at the
    end how many cycles it made."""
    from tests.support.worker import command, emit

    emit("ready")
    command()
    cycles = 0
    while True:
        lease = acquire(names[cycles % len(names)], ttl=30, blocking=False)
        assert lease is not None, "nobody else takes these names"
        assert lease.release()
        cycles += 1
        if cycles == 100:
            emit("running")
        # A look at stdin every 64 cycles: the loop stays tight.
        if cycles % 64 == 0 and select.select([sys.stdin], [], [], 0)[0]:
            break
    emit("done", cycles=cycles)


@pytest.fixture
def warnings_logged(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[str]]]:
    """What gives distlock's warnings so far in the test (a batch that waited out the busy
    timeout logs one before it is run again)."""
    with caplog.at_level(logging.WARNING, logger="distlock"):
        yield lambda: [r.getMessage() for r in caplog.records if r.name.startswith("distlock")]


@pytest.fixture
def short_busy_timeout(idle_rows) -> Iterator[None]:
    with connection.cursor() as cursor:
        cursor.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout = 30000")


@pytest.fixture
def busy_loop(children, idle_rows, short_busy_timeout):
    """A second process cycling three names back to back, running when this returns
    (the idle rows written before it starts: beside it, their own writes starve)."""
    names = [f"hot:{i}" for i in range(3)]
    loop = children.start("tests.test_sqlite_purge:tight_loop", names)
    loop.expect("ready")
    loop.send("go")
    loop.expect("running", timeout=60)
    yield loop
    loop.send("stop")
    assert loop.expect("done", timeout=60)["cycles"] > 100
    assert loop.finish() == 0


@pytest.fixture
def idle_rows() -> None:
    """IDLE_ROWS lock rows freed long ago (expires_us = 1), and as many old events."""
    Lock.objects.bulk_create(
        (Lock(name=f"idle:{i:06d}", token=i + 1, expires_us=1) for i in range(IDLE_ROWS)),
        batch_size=2000,
    )
    LockEvent.objects.bulk_create(
        (LockEvent(at_us=i + 1, kind=LockEvent.Kind.ACQUIRED, name=f"idle:{i:06d}")
         for i in range(IDLE_ROWS)),
        batch_size=2000,
    )


def test_a_purge_beside_a_tight_acquire_loop_finishes(busy_loop, warnings_logged):
    """Lock rows idle for an hour are purged beside the loop within DEADLINE, with no
    batch waiting out the busy timeout; the loop's rows (freed just now) stay."""
    started = time.monotonic()
    deleted = purge_locks(idle=3600)
    took = time.monotonic() - started
    assert deleted == IDLE_ROWS
    assert took < DEADLINE, f"the purge took {took:.1f} s beside the loop"
    assert not warnings_logged(), warnings_logged()
    assert not Lock.objects.filter(name__startswith="idle:").exists()
    assert Lock.objects.filter(name__startswith="hot:").count() == 3


def test_audit_retention_beside_a_tight_acquire_loop_finishes(busy_loop, warnings_logged):
    """Audit retention runs the same batches: the old events go within DEADLINE."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM distlock_lockevent")
        before = cursor.fetchone()[0]
    started = time.monotonic()
    deleted = purge_events(older_than=3600)
    took = time.monotonic() - started
    assert deleted == IDLE_ROWS
    assert took < DEADLINE, f"retention took {took:.1f} s beside the loop"
    assert not warnings_logged(), warnings_logged()
    assert LockEvent.objects.count() == before - IDLE_ROWS

