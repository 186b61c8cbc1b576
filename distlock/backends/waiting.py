"""Waiting's part of a backend: the wake-ups and the queue of waiters.

The portable answer is "waiters only poll": no wake-ups, no queue, nobody knows who waits.
PostgreSQL overrides it (``postgresql.py``, with the functions of
``postgresql_functions.py``): the design is docs/waiting.md.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper


class WaitingSQL:
    """Mixed into :class:`distlock.backends.base.Backend`."""

    def supports_wakeups(self) -> bool:
        """Can a waiting acquire be woken by a release (see wakeups.py)?"""
        return False

    def wait_for_handoff(
        self, connection: BaseDatabaseWrapper, seconds: float, queued: str
    ) -> bool:
        """Wait up to ``seconds`` on a queued connection for the hand-off to queue entry
        ``queued``; True if it came."""
        raise NotImplementedError

    def waiting(self, cursor: Any, limit: int) -> list[tuple[str, int, str]] | None:
        """Locks that blocking acquires wait for right now, as the wake-up registrations
        show them: (name, sessions waiting, who they are), most waited-for first, at most
        ``limit``. None where waiters register nowhere (they only poll), so nobody knows.
        """
        return None

    def waiters(self, cursor: Any, name: str) -> int | None:
        """How many sessions wait for lock ``name`` right now, as the wake-up registrations
        show them (:meth:`waiting` for one name, free or not); None where waiters register
        nowhere, so nobody knows."""
        return None

    def enqueue(
        self, cursor: Any, name: str, first: bool, previous: int, listeners: int
    ) -> tuple[int, bool, int, bool]:
        """Queue for a hand-off of ``name`` (where supports_wakeups()), the ``first``
        time in this wait or again (``previous``: the entry replaced): the entry's id,
        whether the lock looked free (try at once), how many are ahead, and whether this
        waiter listens (fewer than ``listeners`` ahead, or nobody live)."""
        raise NotImplementedError

    def follow(
        self, cursor: Any, name: str, queued: int, wait_ms: int
    ) -> tuple[str, bool, int]:
        """Wait up to ``wait_ms`` behind the waiter ahead of entry ``queued``: what
        happened, whether to try at once, how many ahead left (see PostgreSQL's)."""
        raise NotImplementedError

    def leave(self, cursor: Any, name: str, queued: int) -> None:
        """Undo :meth:`enqueue` (every entry of this session for ``name``)."""
        raise NotImplementedError
