"""How many permits a semaphore may have, and the check of a ``permits=``/``limit=``
argument: a module of its own, importing nothing of the app, so the task decorators can
check ``limit=`` at import time, before Django's app registry is ready."""

from __future__ import annotations

#: The most permits a semaphore may have (each is a row its grants read).
MAX_PERMITS = 1000


def check_permits(permits: object, what: str = "permits") -> int:
    """``permits`` if it is an int from 1 to MAX_PERMITS; TypeError/ValueError otherwise."""
    if isinstance(permits, bool) or not isinstance(permits, int):
        raise TypeError(f"{what} must be an int, not {type(permits).__name__}")
    if not 1 <= permits <= MAX_PERMITS:
        raise ValueError(f"{what} must be from 1 to {MAX_PERMITS}, not {permits}")
    return permits
