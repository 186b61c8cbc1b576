"""Child-process roles for tests/test_semaphores.py and tests/test_rwlocks.py (run by
tests/support/worker.py)."""

from __future__ import annotations

import random
import time

from tests.support.worker import command, emit


def _counter(name: str) -> object:
    from tests.testapp.models import Counter

    return Counter.objects.get(key=name.removeprefix("counter:"))


def _hold(permit: object) -> None:
    """Obey commands for a held permit: "write" (a fenced write), "release", "exit"."""
    from distlock import StaleToken

    emit("acquired", token=permit.token, row=permit.name)  # type: ignore[attr-defined]
    while True:
        order = command()["command"]
        if order == "write":
            counter = _counter(permit.guard_name)  # type: ignore[attr-defined]
            counter.value += 1  # type: ignore[attr-defined]
            try:
                counter.save(fence=permit)  # type: ignore[attr-defined]
                emit("wrote", refused=False)
            except StaleToken:
                emit("wrote", refused=True)
        elif order == "release":
            emit("released", held=permit.release())  # type: ignore[attr-defined]
        elif order == "exit":
            return


def hold_permit(name: str, permits: int, ttl: float) -> None:
    """After a "go": take one permit, then obey commands (see _hold)."""
    from django.db import connection

    from distlock import acquire_permit

    connection.ensure_connection()
    emit("ready")
    command()
    permit = acquire_permit(name, permits=permits, ttl=ttl, timeout=60)
    assert permit is not None
    _hold(permit)


def hold_rw(name: str, write: bool, ttl: float) -> None:
    """Take a read (or write) lease, then obey commands (see _hold)."""
    from distlock import acquire_read, acquire_write

    take = acquire_write if write else acquire_read
    lease = take(name, ttl=ttl, timeout=60)
    assert lease is not None
    _hold(lease)


def cycle_permits(name: str, permits: int, ttl: float, count: int) -> None:
    """After a "go": take a permit, hold it briefly, write under it, release; ``count``
    times."""
    from distlock import acquire_permit

    emit("ready")
    command()
    for _ in range(count):
        permit = acquire_permit(name, permits=permits, ttl=ttl, timeout=60)
        assert permit is not None
        time.sleep(random.uniform(0, 0.02))
        permit.release()
    emit("done")


def cycle_rw(name: str, write: bool, ttl: float, count: int) -> None:
    """After a "go": a read (or write) lease held briefly and released, ``count`` times;
    a writer also writes the counter under its lease."""
    from distlock import acquire_read, acquire_write

    emit("ready")
    command()
    take = acquire_write if write else acquire_read
    for _ in range(count):
        lease = take(name, ttl=ttl, timeout=60)
        assert lease is not None
        if write:
            counter = _counter(name)
            counter.value += 1  # type: ignore[attr-defined]
            counter.save(fence=lease)  # type: ignore[attr-defined]
        time.sleep(random.uniform(0, 0.02))
        lease.release()
    emit("done")
