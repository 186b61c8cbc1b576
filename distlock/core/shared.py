"""What semaphores and read/write locks share: the Permit lease, the grant loops (sync
and async) and the block that holds a permit for a ``with`` block.

A semaphore or read/write lock named ``name`` is a set of ordinary lock rows (a head row
and member rows: distlock/backends/shared_rows.py); a grant is one transaction on the
backend, and what it hands out is a :class:`Permit`, the :class:`~distlock.core.leases.Lease`
of the member row it took. So renewal, release (owner *and* token), break, expiry,
``is_current()`` and auto-renewal are the lock's own, on that row. What differs is
fencing: a permit fences the rows guarded by ``name`` (:attr:`Permit.guard_name`), and
its ownership check reads its own row — the permit must still be held by the database
clock, checked inside the writing transaction.

Waiting polls with the lock's jittered back-off, doubling from ``DISTLOCK_POLL_INTERVAL``
for BACKOFF_STEPS tries only, never past the deadline or the first holder's expiry:
the LISTEN/NOTIFY wake-ups and the queue of :mod:`distlock.waiting` work per lock row,
and a release of a member row is no event anyone listens to.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async
from django.db import DatabaseError, connections

from distlock import db, signals
from distlock.backends import backend_for
from distlock.backends.results import Busy, Grant
from distlock.core import grants
from distlock.core.blocks import _current, _running_task
from distlock.core.grants import Request
from distlock.core.leases import Lease, LostCallback
from distlock.core.shielding import shielded
from distlock.exceptions import NestedLock

# The back-off stops doubling after this many refused tries: DISTLOCK_POLL_INTERVAL × 8
# at most (0.16 s by default; never above DISTLOCK_POLL_MAX_INTERVAL). Nothing wakes a
# waiter when a permit is released, and with N permits releases come often: a pause
# that grew to DISTLOCK_POLL_MAX_INTERVAL left permits free while waiters slept
# (benchmarks/semaphore.py: N = 1 at 40 % of the plain lock's cycles/s).
BACKOFF_STEPS = 3

# (the backend operation's name, its arguments after the cursor): one grant's try.
Attempt = Callable[[Request], tuple[str, tuple[Any, ...]]]


class Permit(Lease):
    """The lease of one member row of a semaphore or read/write lock.

    ``name`` is the row (``"exports#permit:2"``), ``guard_name`` the lock it belongs to
    (``"exports"``): pass the permit as ``fence=`` to write rows guarded by that name.
    ``kind`` says which it is: ``"permit"`` (a semaphore's), ``"read"`` or ``"write"``.
    """

    guard: str = ""
    kind: str = "permit"

    @property
    def guard_name(self) -> str:
        return self.guard

    def __repr__(self) -> str:
        return (
            f"<Permit {self.kind} of {self.guard!r} row={self.name!r} token={self.token} "
            f"owner={self.owner[:8]}…>"
        )


def refuse_nested(family: tuple[str, ...], name: str, alias: str) -> None:
    """NestedLock if a block holding a permit of ``kind`` in ``family`` for ``name`` (in
    the same database) runs here, in this thread or asyncio task: a second permit of the
    same semaphore or read/write lock taken by the holder of the first could wait for
    itself for ever (N = 1; a reader behind a waiting writer; a write inside a read)."""
    task = _running_task()
    for lease, entered_in in reversed(_current.get()):
        if (
            isinstance(lease, Permit) and lease.kind in family and lease.guard == name
            and (entered_in is task or entered_in is None or task is None)
            and not lease._released and not lease.lost
            and db.same_database(lease.using, alias)
        ):
            raise NestedLock(name, lease.token, lease.owner)


def _try(request: Request, attempt: Attempt) -> tuple[str, Grant] | Busy:
    """One grant transaction, committed before it returns."""
    connection = connections[request.alias]
    backend = request.backend = backend_for(connection)
    operation, args = attempt(request)
    try:
        result: tuple[str, Grant] | Busy = db.run_on(connection, backend, operation, *args)
    except DatabaseError as exc:
        # A row-lock wait cut short by the session's own timeout: busy, as for a lock.
        if not backend.lock_wait_cut_short(exc):
            raise
        return Busy(token=0, holder="", remaining_us=None)
    return result


def _permit(
    request: Request, started: float, row: str, result: Grant, kind: str,
) -> Permit:
    """The Permit of a committed grant, announced with ``lock_acquired`` (as a lock's)."""
    backend = request.backend or backend_for(connections[request.alias])
    permit = Permit._granted(
        row, request.owner, result.token, using=request.alias, ttl=request.seconds,
        expires_us=result.expires_us, acquired_us=result.acquired_us,
        holder=request.description, deadline=started + request.seconds - backend.clock_resolution,
    )
    assert isinstance(permit, Permit)
    permit.guard = request.name
    permit.kind = kind
    signals.lock_acquired.send(
        sender=Lease, lease=permit, took_over=result.took_over, waited=started - request.began,
    )
    return permit


def _one(request: Request, attempt: Attempt, kind: str) -> Permit | Busy:
    started = time.monotonic()
    result = _try(request, attempt)
    if isinstance(result, Busy):
        return result
    return _permit(request, started, *result, kind)


def obtain(
    request: Request, attempt: Attempt, kind: str, *, auto_renew: bool = False,
    on_lost: LostCallback | None = None,
) -> Permit | None:
    """Try until granted, or None once ``request`` may wait no longer (``lock_not_acquired``
    sent, as for a lock)."""
    give_up = None if request.wait is None else request.began + request.wait
    tries = 0
    while True:
        result = _one(request, attempt, kind)
        if isinstance(result, Permit):
            if auto_renew:
                result.start_auto_renew(on_lost)
            return result
        left = None if give_up is None else give_up - time.monotonic()
        if grants.gives_up(request, left):
            return None
        time.sleep(grants.pause_before_retry(min(tries, BACKOFF_STEPS), result, left))
        tries += 1


async def _aone(request: Request, attempt: Attempt, kind: str) -> Permit | Busy:
    """One try in Django's sync layer; a grant it made while the caller was cancelled is
    released before the cancellation goes on."""
    task = asyncio.ensure_future(sync_to_async(_one)(request, attempt, kind))
    try:
        return await shielded(task)
    except asyncio.CancelledError:
        if task.done() and not task.cancelled() and task.exception() is None:
            outcome = task.result()
            if isinstance(outcome, Permit):
                with contextlib.suppress(Exception):
                    await outcome.arelease()
        raise


async def aobtain(
    request: Request, attempt: Attempt, kind: str, *, auto_renew: bool = False,
    on_lost: LostCallback | None = None,
) -> Permit | None:
    """:func:`obtain` for async code: waiting is ``asyncio.sleep``, never the loop blocked."""
    give_up = None if request.wait is None else request.began + request.wait
    tries = 0
    while True:
        result = await _aone(request, attempt, kind)
        if isinstance(result, Permit):
            if auto_renew:
                result.start_auto_arenew(on_lost)
            return result
        left = None if give_up is None else give_up - time.monotonic()
        if grants.gives_up(request, left):
            return None
        await asyncio.sleep(grants.pause_before_retry(min(tries, BACKOFF_STEPS), result, left))
        tries += 1


def async_holder(holder: str) -> str:
    """``holder`` with the asyncio task's name, as aacquire() describes its holders."""
    task = asyncio.current_task()
    return f"task={task.get_name()} {holder}".strip() if task is not None else holder

