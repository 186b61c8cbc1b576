"""Worker roles of the hand-off tests (tests/test_wakeups.py), run by tests.support.worker
as ``tests.support.handoff_workers:ROLE``."""

from __future__ import annotations

from typing import Any

from tests.support.worker import command, emit, lease_data

_notified = 0


def _count_notifications() -> None:
    """Count every notification this process's psycopg connections hand out: the wake-ups."""
    import psycopg

    original = psycopg.Connection.notifies

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _notified
        for notify in original(self, *args, **kwargs):
            _notified += 1
            yield notify

    psycopg.Connection.notifies = counting  # type: ignore[method-assign]


def in_line(name: str, grants: int, timeout: float) -> None:
    """After "go": ``grants`` times a blocking acquire of ``name``, released at once;
    "acquired" per grant; "done" with the notifications received."""
    from django.db import connection

    from distlock import acquire

    _count_notifications()
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
    emit("done", notified=_notified)
