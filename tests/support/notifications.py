"""Counting a process's wake-ups in the waiters' queue: the notifications (LISTEN/NOTIFY)
its psycopg connections hand out, and what ended each wait in the queue. The hand-off
tests' workers (``handoff_workers``) and benchmarks/waiters.py report them, to tell a
waiter woken by a release (or by the waiter ahead of it leaving) from one that got the
lock by polling.

Counted by wrapping ``psycopg.Connection.notifies``, which the head of a queue reads its
wake-ups through (distlock's ``wait_for_handoff``), and the PostgreSQL backend's
``follow`` and ``wait_for_handoff``: the real methods run, this only counts, so nothing in
distlock changes for it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

_received = 0
# What ended each wait of this process's queued waiters: "waited" and "timed out" (its
# poll's timer: no wake-up came), "notified", and the other outcomes of distlock_follow;
# "moved up": how often a waiter ahead left, each a wake-up by PostgreSQL's lock manager.
_waits: Counter[str] = Counter()
_counting = False


def count_notifications() -> None:
    """From now on, count every notification this process's psycopg connections hand out
    and what ended each wait in the queue (once per process: a second call does not count
    them twice)."""
    global _counting
    if _counting:
        return
    import psycopg

    from distlock.backends.postgresql import PostgreSQL

    original = psycopg.Connection.notifies

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _received
        for notify in original(self, *args, **kwargs):
            _received += 1
            yield notify

    psycopg.Connection.notifies = counting  # type: ignore[method-assign]
    follow, handoff = PostgreSQL.follow, PostgreSQL.wait_for_handoff

    def following(self: Any, *args: Any) -> tuple[str, bool, int]:
        status, free, moved = follow(self, *args)
        _waits[status] += 1
        _waits["moved up"] += moved
        return status, free, moved

    def handed(self: Any, *args: Any) -> bool:
        came = handoff(self, *args)
        _waits["notified" if came else "timed out"] += 1
        return came

    PostgreSQL.follow = following  # type: ignore[method-assign]
    PostgreSQL.wait_for_handoff = handed  # type: ignore[method-assign]
    _counting = True


def received() -> int:
    """The notifications counted since :func:`count_notifications` or :func:`reset`."""
    return _received


def waits() -> dict[str, int]:
    """What ended the waits in the queue since :func:`count_notifications` or :func:`reset`."""
    return dict(_waits)


def wakeups() -> int:
    """Every wake-up: the notifications and the waiters ahead that left (each wakes the
    one behind it through PostgreSQL's lock manager)."""
    return _received + _waits["moved up"]


def reset() -> None:
    global _received
    _received = 0
    _waits.clear()
