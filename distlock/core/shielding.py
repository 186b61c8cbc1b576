"""Finishing a database operation through a cancellation, then letting the cancellation go on.

A release, a renewal or a give-back that has started must finish: cancelled half-way, a
release would leave the lock held until its ttl, and the lease's state (released, lost)
would be unknown to the code that goes on. ``asyncio.shield`` keeps the operation
running, but on its own it lets the caller leave at once, before the operation is done;
a loop that waits for the operation and *then returns its result* is worse: it swallows
the cancellation, so ``task.cancel()`` is lost (the task finishes normally) and an
``asyncio.timeout`` whose deadline passed raises nothing (the task's ``cancelling()``
count stays up, and on Python 3.11 every later ``asyncio.timeout`` in that task raises
CancelledError instead of TimeoutError).

:func:`shielded` does both halves: the operation runs to its end whatever is cancelled
meanwhile, and then a cancellation that arrived is raised, so ``task.cancel()`` ends the
task and ``asyncio.timeout`` turns it into TimeoutError (its ``uncancel()`` count matches
because each cancellation is raised once, never swallowed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def shielded(operation: Awaitable[T]) -> T:
    """Await ``operation`` to its end even if the caller is cancelled meanwhile.

    Its result if the caller was not cancelled. If it was (once or more), the first
    CancelledError is raised once the operation has finished, with the operation's own
    error, if it failed, as its ``__context__``. The operation is never cancelled by
    the caller's cancellation; if it is cancelled itself (the loop shutting down), that
    CancelledError is raised.
    """
    task = asyncio.ensure_future(operation)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            # asyncio.wait never cancels ``task`` and never raises its error.
            await asyncio.wait((task,))
        except asyncio.CancelledError as exc:
            # The caller was cancelled (perhaps just as the operation ended): it goes on
            # once the operation is done.
            if cancelled is None:
                cancelled = exc
    if cancelled is None:
        return task.result()
    if not task.cancelled():
        error = task.exception()  # retrieved, so asyncio does not log it as never retrieved
        if error is not None and cancelled.__context__ is None:
            cancelled.__context__ = error
    raise cancelled
