"""The async API: aacquire(), alock(), alocked(), abreak_lock() and apurge_locks().

The same guarantees as the sync API, because it is the sync API's steps
(:mod:`distlock.core.grants`) with the waiting done by asyncio:

- **Each database operation runs in Django's sync layer** (``sync_to_async``,
  thread-sensitive), exactly where Django runs the caller's own async ORM calls
  (``aget``, ``asave``): in an ASGI request, the request's thread and connection. So the
  transaction checks of the sync API see the same connection state (a lock operation
  never joins the caller's transaction; a fenced write's open row lock defers a
  release), and the lock's signals and audit rows are written off the event loop. The
  alternatives were measured (``benchmarks/async_api.py``; docs/performance.md): a
  thread-*insensitive* pool runs the operation on another connection than the caller's,
  where those checks look at the wrong state; a native psycopg ``AsyncConnection`` makes
  no thread hop (faster for one coroutine, and for many on different names outside a
  request) but exists for PostgreSQL only and bypasses the checks, signals and audit.
- **Waiting never blocks the loop**: between tries a coroutine awaits its back-off pause
  or, on PostgreSQL, a release's notification through the loop's one shared LISTEN
  connection (:mod:`distlock.waiting.listener`). Waiting costs no thread and no connection.
- **One try at a time per name in each event loop**: the coroutines of a loop waiting for
  one name take turns (FIFO) to send a try. Outside a request all of a loop's
  thread-sensitive calls share one thread, and 200 waiters polling on their own would
  queue hundreds of refused tries there, ahead of the holder's release
  (``benchmarks/async_api.py`` measured the stall: docs/performance.md).
- **Cancellation** (``asyncio.timeout``, ``task.cancel()``) while waiting leaves nothing
  behind: if a try was in flight, it finishes in its thread and a grant it made is
  released before the CancelledError goes on. Cancellation while holding an ``alock``
  block releases the lock as the block ends (the release is shielded from the
  cancellation). A cancellation that arrives *during* a release, renewal or give-back
  waits for it to finish and then goes on (:mod:`distlock.core.shielding`): it is never
  swallowed, so ``task.cancel()`` ends the task and ``asyncio.timeout`` raises
  TimeoutError. Only a process that dies leaves its lease to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async

from distlock.backends.results import Busy
from distlock.core import grants, uncommitted
from distlock.core.blocks import AsyncBlock, refuse_sync
from distlock.core.grants import DEFAULT, Request, grant_lease, pause_before_retry
from distlock.core.leases import Lease, LostCallback
from distlock.core.locks import (
    LockBlock,
    break_lock,
    call_namer,
    name_template,
    refuse_nested,
)
from distlock.core.purge import purge_locks
from distlock.core.shielding import shielded
from distlock.validation import Seconds, refuse_reserved
from distlock.waiting.listener import AsyncWaiter

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


class _Turns:
    """The coroutines of one loop trying one name, one try at a time."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


_turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], _Turns]] = (
    weakref.WeakKeyDictionary()
)


@contextlib.asynccontextmanager
async def _my_turn(request: Request) -> AsyncIterator[None]:
    per_loop = _turns.setdefault(asyncio.get_running_loop(), {})
    key = (request.alias, request.name)
    turns = per_loop.get(key)
    if turns is None:
        turns = per_loop[key] = _Turns()
    turns.users += 1
    try:
        async with turns.lock:
            yield
    finally:
        turns.users -= 1
        if turns.users == 0 and per_loop.get(key) is turns:
            del per_loop[key]


def _attempt(request: Request) -> Lease | Busy:
    """One try, in Django's sync layer: the grant and its lock_acquired signal both."""
    uncommitted.refuse_if_holding(request.name, request.alias, request.doing)
    started = time.monotonic()
    result = grants.try_once(request)
    if isinstance(result, Busy):
        return result
    return grant_lease(request, started, result)


async def _try_or_give_back(request: Request) -> Lease | Busy:
    """One try; if the caller is cancelled meanwhile, a grant the try made is released
    before the cancellation goes on."""
    task = asyncio.ensure_future(sync_to_async(_attempt)(request))
    try:
        return await shielded(task)
    except asyncio.CancelledError:
        # The try has finished in its thread; nobody will hold what it granted. A
        # cancellation during the give-back is raised once the release is done.
        if task.done() and not task.cancelled() and task.exception() is None:
            outcome = task.result()
            if isinstance(outcome, Lease):
                with contextlib.suppress(Exception):
                    await outcome.arelease()
        raise


# aacquire, alocked and abreak_lock repeat the signatures of their sync twins on purpose:
# a public signature has to be written out for help(), IDEs and type checkers to read it.
# The arguments are checked once, in the shared core (grants.Request, name_template,
# break_lock itself).
async def aacquire(
    name: str,
    *,
    ttl: Seconds | None = None,
    blocking: bool = True,
    timeout: Seconds | None = DEFAULT,
    using: str | None = None,
    holder: str = "",
    auto_renew: bool = False,
    on_lost: LostCallback | None = None,
    min_hold: Seconds | None = DEFAULT,
    max_hold: Seconds | None = DEFAULT,
    lock_delay: Seconds | None = DEFAULT,
) -> Lease | None:
    """acquire() for async code: the same arguments, results and exceptions.

    Waiting between tries never blocks the event loop. ``auto_renew`` renews in an
    asyncio task of the running loop (not a thread); ``on_lost`` may be a coroutine
    function. Cancelling the caller leaves no grant behind (see the module docstring).
    Inside an ``alock`` block of the same name in this task (or a ``lock`` block of this
    thread) it raises NestedLock at once (:func:`distlock.core.locks.refuse_nested`).
    """
    task = asyncio.current_task()
    request = Request(
        name, ttl, blocking, timeout, using,
        f"task={task.get_name()} {holder}".strip() if task is not None else holder,
        min_hold, max_hold, lock_delay,
    )
    refuse_reserved(request.name)
    refuse_nested(request.name, request.alias)
    give_up = None if request.wait is None else request.began + request.wait
    attempt = 0
    waiter: AsyncWaiter | None = None
    try:
        while True:
            async with _my_turn(request):
                result = await _try_or_give_back(request)
            if isinstance(result, Lease):
                break
            left = None if give_up is None else give_up - time.monotonic()
            if grants.gives_up(request, left):
                return None
            if waiter is None:
                waiter = AsyncWaiter(request.alias, request.name)
                await waiter.start()
                if waiter.listening:
                    continue  # freed before the LISTEN took effect? Look again at once.
            await waiter.wait(pause_before_retry(attempt, result, left))
            attempt += 1
    finally:
        if waiter is not None:
            waiter.stop()
    if auto_renew:
        result.start_auto_arenew(on_lost)
    return result


class alock(LockBlock, AsyncBlock[Lease]):  # noqa: N801 - reads like a function
    """Hold lock ``name`` for an ``async with`` block (or a decorated coroutine's run).

    The async form of :class:`~distlock.core.locks.lock`: ``async with alock("invoice:42",
    ttl=30, timeout=10) as lease:`` waits up to ``timeout`` seconds (without blocking the
    event loop) and raises LockTimeout if the lock cannot be had. The lock is released
    when the block ends, also on an exception or a cancellation; ``current_lease()``
    returns the lease inside the block, in this task only. Not re-entrant: a nested
    ``alock`` of the same name in the same task raises NestedLock at once. As a
    decorator it takes ``async def`` functions only.
    """

    async def _atake(self) -> Lease | None:
        return await aacquire(self.name, **self._options)


def alocked(
    name: str,
    *,
    ttl: Seconds | None = None,
    timeout: Seconds | None = DEFAULT,
    using: str | None = None,
    auto_renew: bool = False,
    on_lost: LostCallback | None = None,
    min_hold: Seconds | None = DEFAULT,
    max_hold: Seconds | None = DEFAULT,
    lock_delay: Seconds | None = DEFAULT,
) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], Callable[P, Coroutine[Any, Any, R]]]:
    """locked() for ``async def`` functions: each call runs under ``alock`` named from
    its arguments. A plain function raises TypeError at decoration."""
    template = name_template(name, ttl, timeout, min_hold, max_hold, lock_delay)

    def decorate(
        func: Callable[P, Coroutine[Any, Any, R]],
    ) -> Callable[P, Coroutine[Any, Any, R]]:
        refuse_sync(func, "@alocked(...)")
        namer = call_namer(template, func)

        @functools.wraps(func)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            async with alock(
                namer(args, kwargs), ttl=ttl, timeout=timeout,
                using=using, auto_renew=auto_renew, on_lost=on_lost,
                min_hold=min_hold, max_hold=max_hold, lock_delay=lock_delay,
            ):
                return await func(*args, **kwargs)

        return wrapper

    return decorate


async def abreak_lock(
    name: str,
    *,
    owner: str | None = None,
    token: int | None = None,
    using: str | None = None,
    by: str = "",
) -> bool:
    """break_lock() for async code."""
    return await sync_to_async(break_lock)(name, owner=owner, token=token, using=using, by=by)


async def apurge_locks(*, idle: Seconds = timedelta(days=1), using: str | None = None) -> int:
    """purge_locks() for async code."""
    return await sync_to_async(purge_locks)(idle=idle, using=using)
