"""Counting the notifications (LISTEN/NOTIFY wake-ups) a process's psycopg connections
hand out: the hand-off tests' workers (``handoff_workers``) and benchmarks/waiters.py
report it, to tell a waiter woken by a release from one that got the lock by polling.

Counted by wrapping ``psycopg.Connection.notifies``, which every sync waiter reads its
wake-ups through (distlock's ``wait_for_handoff``), so nothing in distlock changes for it.
"""

from __future__ import annotations

from typing import Any

_received = 0
_counting = False


def count_notifications() -> None:
    """From now on, count every notification this process's psycopg connections hand out
    (once per process: a second call does not count them twice)."""
    global _counting
    if _counting:
        return
    import psycopg

    original = psycopg.Connection.notifies

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _received
        for notify in original(self, *args, **kwargs):
            _received += 1
            yield notify

    psycopg.Connection.notifies = counting  # type: ignore[method-assign]
    _counting = True


def received() -> int:
    """The notifications counted since :func:`count_notifications` or :func:`reset`."""
    return _received


def reset() -> None:
    global _received
    _received = 0
