"""acquire(), lock() and locked(): getting a lease, once or with waiting."""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

from django.db import connections

from distlock import db, signals
from distlock.backends.results import Busy, Grant
from distlock.core import grants, policies, uncommitted
from distlock.core.blocks import (
    Block,
    SyncBlock,
    _current,
    _push,
    _running_task,
    refuse_async,
)
from distlock.core.grants import DEFAULT, Request, grant_lease, pause_before_retry
from distlock.core.leases import Lease, LostCallback
from distlock.exceptions import NestedLock
from distlock.names import NameTemplate
from distlock.validation import (
    Seconds,
    check_lock_name,
    check_name,
    check_owner,
    check_text,
    check_token,
    check_ttl,
    check_using,
    refuse_reserved,
)
from distlock.waiting.queue import Turn, Waiter, has_queue, poke, queue_for

P = ParamSpec("P")
R = TypeVar("R")


def current_lease() -> Lease | None:
    """The lease of the innermost ``lock()`` block (or locked task) running here, if any."""
    leases = _current.get()
    return leases[-1][0] if leases else None


@contextmanager
def as_current(lease: Lease) -> Iterator[Lease]:
    """Make ``lease`` what :func:`current_lease` returns for the ``with`` block, without
    acquiring or releasing it (a periodic job's run: distlock/periodic.py)."""
    token = _push(lease)
    try:
        yield lease
    finally:
        _current.reset(token)


def refuse_nested(name: str, alias: str) -> None:
    """Raise NestedLock if a ``lock()``/``alock()`` block holding ``name`` in ``alias``'s
    database (through any alias) runs here: in this thread, or in this asyncio task.

    The holder is the thread (sync code) or the asyncio task (async code) that entered the
    block, with what it runs on its own behalf and carries its context: sync code called
    through ``sync_to_async`` from the task, a coroutine run through ``async_to_sync`` (or
    ``asyncio.run``) from the thread. A task *created* inside the block inherits a copy of
    the context but is another holder: its acquire waits for the block to end, as any
    other holder's would (sync code it runs through ``sync_to_async`` cannot be told from
    its creator's and counts as the creator's). A block whose lease was released or lost
    inside it does not count. Leases from ``acquire()`` held without a block are not
    tracked: a lease may be handed to another thread.
    """
    held = _current.get()
    if not held:
        return
    task = _running_task()
    for lease, entered_in in reversed(held):
        if (
            lease.name == name
            and (entered_in is task or entered_in is None or task is None)
            and not lease._released and not lease.lost
            and db.same_database(lease.using, alias)
        ):
            raise NestedLock(name, lease.token, lease.owner)


def acquire(
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
    """Acquire lock ``name`` and return its Lease, or None if it could not be had.

    Like ``threading.Lock.acquire``: with ``blocking=False`` one try is made; otherwise
    distlock retries with jittered exponential back-off until ``timeout`` seconds have
    passed (default ``DISTLOCK_DEFAULT_TIMEOUT``; None waits for as long as it takes).
    The grant is committed before this returns. ``ttl`` (seconds or timedelta) is the
    lease length, counted by the database clock. ``auto_renew`` renews in a helper
    thread; ``on_lost(lease, exc)`` is called there if a renewal fails. ``min_hold``,
    ``max_hold`` and ``lock_delay`` are the lease policies (default: their
    ``DISTLOCK_*`` settings; None: none), judged by the database clock
    (docs/lease-policies.md).

    Raises TypeError/ValueError for bad arguments (nothing is written), NestedLock at
    once inside a ``lock()`` block of the same name in this thread (see
    :func:`refuse_nested`), TransactionNotAllowed inside ``atomic()`` (or with autocommit
    off) on the lock's database or while this thread's open transaction holds an
    uncommitted fenced write under the same lock, TokenExhausted when the 64-bit token
    would overflow, and database errors as Django raises them — except
    a wait for the lock row cut short by the connection's own ``lock_timeout``,
    ``statement_timeout`` or ``innodb_lock_wait_timeout``, which counts as busy.
    """
    request = Request(
        name, ttl, blocking, timeout, using, holder, min_hold, max_hold, lock_delay
    )
    refuse_reserved(request.name)
    refuse_nested(request.name, request.alias)
    uncommitted.refuse_if_holding(request.name, request.alias, request.doing)
    give_up = None if request.wait is None else request.began + request.wait
    # The holder's clock starts before the request leaves, so its deadline is never
    # later than the one the database computes.
    started = time.monotonic()
    result: Grant | Busy | None = None
    # A blocking acquire that finds threads of this process waiting for the name joins
    # their queue without a try of its own, so it cannot overtake them; timeout=0 is one
    # try, like blocking=False (it could not wait for a turn anyway).
    if not (blocking and request.wait != 0 and has_queue(request.alias, request.name)):
        result = grants.try_once(request)
        if not blocking and isinstance(result, Busy):
            grants.gives_up(request, None)
            return None
    else:
        # Refused inside a transaction at once, as the first try would be, not after
        # waiting for a turn in the queue.
        db.refuse_atomic(connections[request.alias])
    if not isinstance(result, Grant):
        with queue_for(request.alias, request.name, give_up) as turn:
            if turn is None:
                grants.gives_up(request, 0.0)
                return None
            granted = _wait_in_turn(request, give_up, turn, result if turn.arrived_first else None)
        if granted is None:
            return None
        started, result = granted
    lease = grant_lease(request, started, result)
    if auto_renew:
        lease.start_auto_renew(on_lost)
    return lease


def _wait_in_turn(
    request: Request, give_up: float | None, turn: Turn, busy: Busy | None
) -> tuple[float, Grant] | None:
    """Retry until granted or ``give_up``, as the first of this process's waiters for the
    name; ``busy`` is the refusal just received, if nothing happened since."""
    attempt = 0
    waiter: Waiter | None = None
    try:
        while True:
            if busy is None:
                started = time.monotonic()
                result = grants.try_once(request)
                if isinstance(result, Grant):
                    return started, result
                busy = result
            left = None if give_up is None else give_up - time.monotonic()
            if grants.gives_up(request, left):
                return None
            if waiter is None:
                waiter = Waiter(request.alias, request.name, turn.freed)
                if waiter.free:
                    busy = None
                    continue  # freed before it queued: look again at once.
            if waiter.listening:
                waiter.wait(waiter.queued_pause(busy, left))
            else:
                waiter.wait(pause_before_retry(attempt, busy, left))
            busy = None
            attempt += 1
    finally:
        if waiter is not None:
            waiter.stop()


class LockBlock(Block[Lease]):
    """What ``lock`` and ``alock`` share: their options, checked at construction."""

    def __init__(
        self,
        name: str,
        *,
        ttl: Seconds | None = None,
        timeout: Seconds | None = DEFAULT,
        using: str | None = None,
        holder: str = "",
        auto_renew: bool = False,
        on_lost: LostCallback | None = None,
        min_hold: Seconds | None = DEFAULT,
        max_hold: Seconds | None = DEFAULT,
        lock_delay: Seconds | None = DEFAULT,
    ) -> None:
        check_lock_name(name)
        policies.resolve(check_ttl(ttl), min_hold, max_hold, lock_delay)
        self._keep(name, {
            "ttl": ttl, "timeout": timeout, "using": using,
            "holder": holder, "auto_renew": auto_renew, "on_lost": on_lost,
            "min_hold": min_hold, "max_hold": max_hold, "lock_delay": lock_delay,
        })


class lock(LockBlock, SyncBlock[Lease]):  # noqa: N801 - reads like a function, as contextlib's do
    """Hold lock ``name`` for a ``with`` block (or a decorated function's call).

    ``with lock("invoice:42", ttl=30, timeout=10) as lease:`` waits up to ``timeout``
    seconds and raises LockTimeout if the lock cannot be had (``timeout=0`` tries once).
    The lock is released when the block ends, also on an exception. Not re-entrant: a
    nested ``lock()`` of the same name in the same thread raises NestedLock at once
    (use the outer lease). If the lease was
    lost on the way (expired, broken), leaving the block logs a warning and sends
    ``lock_lost``; it does not raise, because the block's work is done by then — guard
    writes with fencing (``save(fence=lease)``) to make a stale holder's writes fail.

    As a decorator it refuses ``async def`` functions with TypeError (see
    :func:`~distlock.core.blocks.refuse_async`; ``alock`` is the async form).
    """

    def _take(self) -> Lease | None:
        return acquire(self.name, **self._options)


def name_template(
    name: str, ttl: Seconds | None, timeout: Seconds | None, *held: object
) -> NameTemplate:
    """The checked template of ``locked``/``alocked`` (checked at decoration, not at call);
    ``held`` are the lease policies, if given (min_hold, max_hold, lock_delay)."""
    template = NameTemplate(name)
    seconds = check_ttl(ttl)
    if held:
        policies.resolve(seconds, *held)
    grants.wait_limit(timeout)
    return template


def call_namer(template: NameTemplate, func: Callable[..., Any]) -> Callable[..., str]:
    """``namer(args, kwargs)``: the lock name of one call of ``func``."""
    signature = inspect.signature(func)
    template.check_parameters(signature.parameters, func.__qualname__)
    return functools.partial(template.format_call, signature)


def locked(
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
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function so each call runs under a lock named from its arguments.

    ``name`` is a ``str.format`` template over the function's parameters, e.g.
    ``@locked("report:{customer_id}", ttl=60)``. Inside, ``current_lease()`` returns the
    lease. A template field that is not a parameter raises ValueError at decoration, and
    an ``async def`` function (or async generator function) raises TypeError there: the
    lock would not be held while its body runs (``alocked`` is the async form).
    """
    template = name_template(name, ttl, timeout, min_hold, max_hold, lock_delay)

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        refuse_async(func, "@locked(...)")
        namer = call_namer(template, func)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with lock(
                namer(args, kwargs), ttl=ttl, timeout=timeout,
                using=using, auto_renew=auto_renew, on_lost=on_lost,
                min_hold=min_hold, max_hold=max_hold, lock_delay=lock_delay,
            ):
                return func(*args, **kwargs)

        return wrapper

    return decorate


def break_lock(
    name: str,
    *,
    owner: str | None = None,
    token: int | None = None,
    using: str | None = None,
    by: str = "",
) -> bool:
    """Free lock ``name`` whoever holds it; True if a held lock was broken.

    Give the ``owner`` and/or ``token`` you saw to break only that grant: if the lock has
    changed hands since, nothing happens (False). The broken holder's renew, release
    and fenced writes then fail, and the next grant gets a higher token.

    Raises TypeError/ValueError before any SQL for a bad name, owner, token, alias or
    ``by`` (a str, without NUL characters or lone surrogates); nothing is broken then.
    """
    # ``by`` first: it is only written after the lock is broken (the lock_broken signal,
    # the audit), where a bad value would fail with the lock already freed.
    check_text(by, "by")
    name = check_name(name)
    if owner is not None:
        check_owner(owner)
    if token is not None:
        check_token(token)
    alias = check_using(using)
    uncommitted.refuse_if_holding(name, alias, f"breaking lock {name!r}")
    broken: tuple[str, int, str] | None = db.run(alias, "break_lock", name, owner, token)
    if broken is None:
        return False
    poke(alias, name)
    signals.lock_broken.send(
        sender=None, name=name, owner=broken[0], token=broken[1], holder=broken[2],
        using=alias, by=by,
    )
    return True
