"""Child-process roles for tests/test_groups.py (run by tests/support/worker.py)."""

from __future__ import annotations

from tests.support.helpers import us
from tests.support.worker import command, emit


def cycle_group(names: list[str], count: int, ttl: float, timeout: float) -> None:
    """After a "go": ``lock_all(names)`` (in the order given) ``count`` times.

    Reports, per grant, each member's token, grant and release times (database
    microseconds), and whether it was still held at its release.
    """
    from distlock import lock_all

    emit("ready")
    command()
    seen = []
    for _ in range(count):
        with lock_all(names, ttl=ttl, timeout=timeout) as group:
            leases = group.leases
        seen.append({
            lease.name: [lease.token, us(lease.acquired_at), us(lease.released_at)]
            for lease in leases
        })
    emit("done", grants=seen)
