"""Child-process roles for tests/test_lease_policies.py (run by tests/support/worker.py)."""

from __future__ import annotations

from tests.support.helpers import us
from tests.support.worker import command, emit, lease_data


def hold_with_delay(name: str, ttl: float, lock_delay: float) -> None:
    """Acquire ``name`` with a lock-delay, report the lease, then wait to be killed."""
    from distlock import acquire

    lease = acquire(name, ttl=ttl, lock_delay=lock_delay, timeout=30)
    assert lease is not None
    emit("acquired", **lease_data(lease))
    command()  # never comes: the parent SIGKILLs this process


def try_once(name: str) -> None:
    """One non-blocking try after a "go" (connected first, so start-up is not timed)."""
    from django.db import connection

    from distlock import acquire

    connection.ensure_connection()
    emit("ready")
    command()
    lease = acquire(name, ttl=30, blocking=False)
    if lease is None:
        emit("busy")
    else:
        emit("acquired", **lease_data(lease), released_us=us(lease.released_at))
