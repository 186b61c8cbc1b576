"""acquire(), lock() and locked(): getting a lease, once or with waiting."""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from contextlib import ContextDecorator
from datetime import timedelta
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import iscoroutinefunction
from django.db import DatabaseError, connections

from distlock import db, signals, uncommitted
from distlock.backends import backend_for
from distlock.backends.base import Busy, Grant
from distlock.conf import conf
from distlock.constants import HOLDER_LENGTH, PURGE_BATCH
from distlock.exceptions import LockTimeout
from distlock.leases import Lease, LostCallback, logger
from distlock.names import NameTemplate
from distlock.times import from_us
from distlock.validation import (
    Seconds,
    check_name,
    check_owner,
    check_seconds,
    check_text,
    check_timeout,
    check_token,
    check_ttl,
    check_using,
)
from distlock.wakeups import Waiter

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

_current: contextvars.ContextVar[tuple[Lease, ...]] = contextvars.ContextVar(
    "distlock_leases", default=()
)
_DEFAULT = object()


def current_lease() -> Lease | None:
    """The lease of the innermost ``lock()`` block (or locked task) running here, if any."""
    leases = _current.get()
    return leases[-1] if leases else None


@functools.cache
def _hostname() -> str:
    # A system call per acquire otherwise; a host is not renamed under a running process.
    return socket.gethostname()


def describe_holder(extra: str = "") -> str:
    """Who is asking, for people reading the lock table: host, pid, thread (and ``extra``)."""
    thread = threading.current_thread().name
    parts = [_hostname(), f"pid={os.getpid()}", f"thread={thread}"]
    if extra:
        parts.append(extra)
    return " ".join(parts)[:HOLDER_LENGTH]


def refuse_async(func: object, decorator: str) -> None:
    """Raise TypeError if ``func`` is a coroutine or async generator function.

    A sync wrapper would take the lock, call ``func`` — which only creates the coroutine
    or generator, running none of its body — and release the lock before anything was
    awaited: the body would run unprotected. Refused at decoration, so it fails at
    import rather than silently in production.
    """
    if iscoroutinefunction(func):
        kind = "a coroutine function"
    elif inspect.isasyncgenfunction(func):
        kind = "an async generator function"
    else:
        return
    what = getattr(func, "__qualname__", repr(func))
    raise TypeError(
        f"{decorator} cannot guard {what}(), {kind}: distlock's sync lock would be taken "
        "and released around creating it, not around running it. An async API "
        "(alock/alocked) is planned; until then call the sync lock inside "
        "sync_to_async, or hold it around the awaited work in a thread."
    )


def _try_once(alias: str, name: str, owner: str, holder: str, ttl_us: int) -> Grant | Busy:
    try:
        while True:
            result: Grant | Busy | None = db.run(
                alias, "acquire_existing", name, owner, holder, ttl_us
            )
            if result is not None:
                return result
            created: Grant | None = db.run(alias, "acquire_new", name, owner, holder, ttl_us)
            if created is not None:
                return created
            # Another process created the row between our two transactions: go round
            # again, this time the row exists.
    except DatabaseError as exc:
        # The caller's connection has a lock_timeout/statement_timeout (or MariaDB's
        # innodb_lock_wait_timeout) shorter than another transaction's hold on the lock
        # row: that is contention, so busy (retried within acquire's own timeout), not
        # an error. The aborted try wrote nothing.
        if not backend_for(connections[alias]).lock_wait_cut_short(exc):
            raise
        return Busy(token=0, holder="", remaining_us=None)


def _pause(attempt: int, busy: Busy, left: float | None) -> float:
    """Jittered exponential back-off, never past the deadline or the holder's expiry."""
    base = float(conf.POLL_INTERVAL) * (2 ** min(attempt, 20))
    pause: float = min(float(conf.POLL_MAX_INTERVAL), base) * random.uniform(0.5, 1.0)
    # Wake just after the holder's lease ends: it is free then even if never released.
    if busy.remaining_us is not None:
        pause = min(pause, busy.remaining_us / 1e6 + 0.001)
    if left is not None:
        pause = min(pause, left)
    return max(pause, 0.0)


def acquire(
    name: str,
    *,
    ttl: Seconds | None = None,
    blocking: bool = True,
    timeout: Seconds | None = _DEFAULT,  # type: ignore[assignment]
    using: str | None = None,
    holder: str = "",
    auto_renew: bool = False,
    on_lost: LostCallback | None = None,
) -> Lease | None:
    """Acquire lock ``name`` and return its Lease, or None if it could not be had.

    Like ``threading.Lock.acquire``: with ``blocking=False`` one try is made; otherwise
    distlock retries with jittered exponential back-off until ``timeout`` seconds have
    passed (default ``DISTLOCK_DEFAULT_TIMEOUT``; None waits for as long as it takes).
    The grant is committed before this returns. ``ttl`` (seconds or timedelta) is the
    lease length, counted by the database clock. ``auto_renew`` renews in a helper
    thread; ``on_lost(lease, exc)`` is called there if a renewal fails.

    Raises TypeError/ValueError for bad arguments (nothing is written),
    TransactionNotAllowed inside ``atomic()`` (or with autocommit off) on the lock's
    database or while this thread's open transaction holds an uncommitted fenced write
    under the same lock, TokenExhausted when
    the 64-bit token would overflow, and database errors as Django raises them — except
    a wait for the lock row cut short by the connection's own ``lock_timeout``,
    ``statement_timeout`` or ``innodb_lock_wait_timeout``, which counts as busy.
    """
    name = check_name(name)
    seconds = check_ttl(ttl)
    wait = check_timeout(conf.DEFAULT_TIMEOUT if timeout is _DEFAULT else timeout)
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be a bool, not {type(blocking).__name__}")
    check_text(holder, "holder")
    alias = check_using(using)
    uncommitted.refuse_if_holding(name, alias, f"acquiring lock {name!r}")
    # 128 random bits, as a uuid4 has (less its fixed version bits), at a quarter of the cost.
    owner = os.urandom(16).hex()
    description = describe_holder(holder)
    ttl_us = round(seconds * 1e6)
    give_up = None if wait is None else time.monotonic() + wait
    attempt = 0
    waiter: Waiter | None = None
    try:
        while True:
            # The holder's clock starts before the request leaves, so its deadline is
            # never later than the one the database computes.
            started = time.monotonic()
            result = _try_once(alias, name, owner, description, ttl_us)
            if isinstance(result, Grant):
                break
            left = None if give_up is None else give_up - time.monotonic()
            if not blocking or (left is not None and left <= 0):
                return None
            if waiter is None:
                waiter = Waiter(alias, name)
                if waiter.listening:
                    continue  # freed before the LISTEN took effect? Look again at once.
            waiter.wait(_pause(attempt, result, left))
            attempt += 1
    finally:
        if waiter is not None:
            waiter.stop()
    lease = Lease._granted(
        name, owner, result.token, using=alias, ttl=seconds,
        expires_at=from_us(result.expires_us), acquired_at=from_us(result.acquired_us),
        holder=description,
        deadline=started + seconds - backend_for(connections[alias]).clock_resolution,
    )
    signals.lock_acquired.send(sender=Lease, lease=lease, took_over=result.took_over)
    if auto_renew:
        lease.start_auto_renew(on_lost)
    return lease


class lock(ContextDecorator):  # noqa: N801 - reads like a function, as contextlib's do
    """Hold lock ``name`` for a ``with`` block (or a decorated function's call).

    ``with lock("invoice:42", ttl=30, timeout=10) as lease:`` waits up to ``timeout``
    seconds and raises LockTimeout if the lock cannot be had (``timeout=0`` tries once).
    The lock is released when the block ends, also on an exception. If the lease was
    lost on the way (expired, broken), leaving the block logs a warning and sends
    ``lock_lost``; it does not raise, because the block's work is done by then — guard
    writes with fencing (``save(fence=lease)``) to make a stale holder's writes fail.

    As a decorator it refuses ``async def`` functions with TypeError (see
    :func:`refuse_async`).
    """

    def __init__(
        self,
        name: str,
        *,
        ttl: Seconds | None = None,
        timeout: Seconds | None = _DEFAULT,  # type: ignore[assignment]
        using: str | None = None,
        holder: str = "",
        auto_renew: bool = False,
        on_lost: LostCallback | None = None,
    ) -> None:
        # Check everything now, so a bad decorator fails at import, not at first call.
        check_name(name)
        check_ttl(ttl)
        check_timeout(conf.DEFAULT_TIMEOUT if timeout is _DEFAULT else timeout)
        check_text(holder, "holder")
        if using is not None:
            check_using(using)
        self.name = name
        self._options: dict[str, Any] = {
            "ttl": ttl, "timeout": timeout, "using": using,
            "holder": holder, "auto_renew": auto_renew, "on_lost": on_lost,
        }
        self.lease: Lease | None = None
        self._token: contextvars.Token[tuple[Lease, ...]] | None = None

    def __call__(self, func: F) -> F:
        """Decorate ``func``; a coroutine or async generator function is refused."""
        refuse_async(func, "@lock(...)")
        return super().__call__(func)

    def _recreate_cm(self) -> lock:
        # A decorated function may run in several threads at once: one lock object each.
        return type(self)(self.name, **self._options)

    def __enter__(self) -> Lease:
        lease = acquire(self.name, **self._options)
        if lease is None:
            timeout = self._options["timeout"]
            wait = check_timeout(conf.DEFAULT_TIMEOUT if timeout is _DEFAULT else timeout)
            raise LockTimeout(self.name, wait)
        self.lease = lease
        self._token = _current.set((*_current.get(), lease))
        return lease

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease, self.lease = self.lease, None
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        if lease is None:
            return
        if not lease.release() and not lease.lost:
            logger.warning(
                "lock %r (token %s) was no longer held when its block ended",
                lease.name, lease.token,
            )
            lease._lose("it expired or was taken over before the block ended")


def locked(
    name: str,
    *,
    ttl: Seconds | None = None,
    timeout: Seconds | None = _DEFAULT,  # type: ignore[assignment]
    using: str | None = None,
    auto_renew: bool = False,
    on_lost: LostCallback | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function so each call runs under a lock named from its arguments.

    ``name`` is a ``str.format`` template over the function's parameters, e.g.
    ``@locked("report:{customer_id}", ttl=60)``. Inside, ``current_lease()`` returns the
    lease. A template field that is not a parameter raises ValueError at decoration, and
    an ``async def`` function (or async generator function) raises TypeError there: the
    lock would not be held while its body runs.
    """
    template = NameTemplate(name)
    check_ttl(ttl)
    check_timeout(conf.DEFAULT_TIMEOUT if timeout is _DEFAULT else timeout)

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        refuse_async(func, "@locked(...)")
        signature = inspect.signature(func)
        template.check_parameters(signature.parameters, func.__qualname__)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with lock(
                template.format_call(signature, args, kwargs), ttl=ttl, timeout=timeout,
                using=using, auto_renew=auto_renew, on_lost=on_lost,
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
    signals.lock_broken.send(
        sender=None, name=name, owner=broken[0], token=broken[1], holder=broken[2],
        using=alias, by=by,
    )
    return True


def purge_locks(*, idle: Seconds = timedelta(days=1), using: str | None = None) -> int:
    """Delete lock rows free or expired for at least ``idle``; return how many.

    Fencing tokens stay safe: each deleting transaction raises the token floor to the
    largest token it deletes, and new rows start above the floor, so a purged name that
    comes back gets a higher token than it ever had. Rows are deleted in batches of
    ``PURGE_BATCH`` names, one short transaction each, so a purge of a large table never
    holds row locks for long; rows that become idle while it runs may be left for the
    next purge.
    """
    seconds = check_seconds(idle, "idle")
    if seconds < 0:
        raise ValueError(f"idle must not be negative, not {seconds}")
    alias = check_using(using)
    uncommitted.refuse_if_holding(None, alias, "purging locks")
    idle_us = round(seconds * 1e6)
    purged = 0
    after: str | None = ""
    while after is not None:
        deleted, after = db.run(alias, "purge_batch", idle_us, after, PURGE_BATCH)
        purged += deleted
    return purged
