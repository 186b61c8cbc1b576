"""Worker roles of the hand-off tests (tests/test_wakeups.py), run by tests.support.worker
as ``tests.support.handoff_workers:ROLE``."""

from __future__ import annotations

from tests.support.notifications import count_notifications, received
from tests.support.worker import command, emit, lease_data


def in_line(name: str, grants: int, timeout: float) -> None:
    """After "go": ``grants`` times a blocking acquire of ``name``, released at once;
    "acquired" per grant; "done" with the notifications received."""
    from django.db import connection

    from distlock import acquire

    count_notifications()
    connection.ensure_connection()
    emit("ready", backend_pid=connection.connection.info.backend_pid)
    command()
    for _ in range(grants):
        lease = acquire(name, ttl=60, timeout=timeout)
        if lease is None:
            emit("timeout")
            return
        emit("acquired", **lease_data(lease))
        lease.release()
    emit("done", notified=received())
