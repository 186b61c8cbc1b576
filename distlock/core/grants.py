"""The steps of getting a lease, shared by the sync API (locks.py) and the async one.

One acquire is: check the arguments once (:class:`Request`), try the lock (:func:`try_once`,
one short transaction), pause before trying again (:func:`pause_before_retry`), and turn
the committed grant into a Lease (:func:`grant_lease`). ``acquire()`` runs the steps in the
caller's thread and waits with ``time.sleep``/LISTEN; ``aacquire()`` runs each try in
Django's sync layer and waits with ``asyncio``. Keeping the steps here keeps the two
loops honest copies of one algorithm.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from typing import Any

from django.db import DatabaseError, connections

from distlock import db, signals
from distlock.backends import backend_for
from distlock.backends.base import Backend
from distlock.backends.results import Busy, Grant
from distlock.conf import conf
from distlock.constants import HOLDER_LENGTH
from distlock.core import policies
from distlock.core.leases import Lease, logger
from distlock.validation import (
    Seconds,
    check_name,
    check_text,
    check_timeout,
    check_ttl,
    check_using,
)

# The ``timeout`` default: DISTLOCK_DEFAULT_TIMEOUT, read when the lock is asked for (and
# the lease policies' default: their DISTLOCK_* settings).
DEFAULT: Any = policies.DEFAULT


# "host pid=N thread=": the same for every acquire of this process. Made at the first
# acquire (a host is not renamed under a running process; gethostname and getpid are
# system calls) and again in a child after fork, which has a pid of its own.
_host_pid: str | None = None


def _forget_pid() -> None:
    global _host_pid
    _host_pid = None


os.register_at_fork(after_in_child=_forget_pid)


def describe_holder(extra: str = "") -> str:
    """Who is asking, for people reading the lock table: host, pid, thread (and ``extra``)."""
    global _host_pid
    prefix = _host_pid
    if prefix is None:
        prefix = _host_pid = f"{socket.gethostname()} pid={os.getpid()} thread="
    text = prefix + threading.current_thread().name
    if extra:
        text = f"{text} {extra}"
    return text[:HOLDER_LENGTH]


def wait_limit(timeout: Seconds | None) -> float | None:
    """``timeout`` checked, with DISTLOCK_DEFAULT_TIMEOUT for the default."""
    return check_timeout(conf.DEFAULT_TIMEOUT if timeout is DEFAULT else timeout)


class Request:
    """One acquire's arguments, checked before any SQL, and the owner id of its grant."""

    __slots__ = (
        "alias", "backend", "began", "blocking", "delay_us", "description", "name", "owner",
        "policies", "seconds", "ttl_us", "wait",
    )

    def __init__(
        self, name: str, ttl: Seconds | None, blocking: bool, timeout: Seconds | None,
        using: str | None, holder: str, min_hold: object = DEFAULT,
        max_hold: object = DEFAULT, lock_delay: object = DEFAULT,
    ) -> None:
        self.name = check_name(name)
        self.seconds = check_ttl(ttl)
        self.policies = policies.resolve(self.seconds, min_hold, max_hold, lock_delay)
        self.wait = wait_limit(timeout)
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be a bool, not {type(blocking).__name__}")
        self.blocking = blocking
        check_text(holder, "holder")
        self.alias = check_using(using)
        # The alias's backend, once try_once() has looked it up (grant_lease reads it).
        self.backend: Backend | None = None
        # 128 random bits, as a uuid4 has (less its fixed version bits), at a quarter of
        # the cost.
        self.owner = os.urandom(16).hex()
        self.description = describe_holder(holder)
        self.ttl_us = round(self.seconds * 1e6)
        self.delay_us = 0
        if self.policies is not None:
            # Named in the holder text; the lock-delay carried in the row's expiry.
            self.description = (self.policies.label + self.description)[:HOLDER_LENGTH]
            self.delay_us = self.policies.delay_us
            self.ttl_us += self.delay_us
        # When the caller asked: the start of the wait that lock_acquired and
        # lock_not_acquired report (one clock read per acquire, not per try).
        self.began = time.monotonic()

    @property
    def doing(self) -> str:
        """What is refused, for TransactionNotAllowed's message."""
        return f"acquiring lock {self.name!r}"


def try_once(request: Request) -> Grant | Busy:
    """One try for the lock, committed before it returns: a Grant, or Busy with the holder."""
    name, owner = request.name, request.owner
    holder, ttl_us = request.description, request.ttl_us
    # Looked up once per try, not once per step (see db.run_on).
    connection = connections[request.alias]
    backend = request.backend = backend_for(connection)
    try:
        while True:
            result: Grant | Busy | None = db.run_on(
                connection, backend, "acquire_existing", name, owner, holder, ttl_us
            )
            if result is not None:
                return result
            created: Grant | None = db.run_on(
                connection, backend, "acquire_new", name, owner, holder, ttl_us
            )
            if created is not None:
                return created
            # Another process created the row between our two transactions: go round
            # again, this time the row exists.
    except DatabaseError as exc:
        # The caller's connection has a lock_timeout/statement_timeout (or MariaDB's
        # innodb_lock_wait_timeout) shorter than another transaction's hold on the lock
        # row: that is contention, so busy (retried within acquire's own timeout), not
        # an error. The aborted try wrote nothing.
        if not backend.lock_wait_cut_short(exc):
            raise
        return Busy(token=0, holder="", remaining_us=None)


def gives_up(request: Request, left: float | None) -> bool:
    """After a busy try: True if the acquire returns None now (``lock_not_acquired`` sent).

    It gives up when it may not wait (``blocking=False``) or its ``timeout`` has run out.
    The sync and async loops both ask here, so the signal means the same for both.
    ``timed_out`` is False for an acquire that was not to wait at all (``blocking=False``
    or ``timeout=0``: a busy try), True for one that waited its whole timeout.
    """
    if request.blocking and (left is None or left > 0):
        return False
    signals.lock_not_acquired.send(
        sender=Lease, name=request.name, using=request.alias,
        timed_out=bool(request.blocking and request.wait),
        waited=time.monotonic() - request.began,
    )
    return True


_warned_mixed = False


def warn_mixed_wakeups(busy: Busy) -> None:
    """Warn once per process when a polling waiter finds a lock handed to a queued one.

    A release with waiters queued by processes whose ``DISTLOCK_WAKEUPS`` is on reserves
    the lock for the oldest of them, so a process that polls (wake-ups off, e.g. behind
    PgBouncer) is refused every time while the queue lasts: 0 grants in 29 s beside four
    queued processes with about 125 each (issue 27, item 5). distlock does not make such
    a mix fair; every process using a lock database must share the setting
    (docs/deployment.md), and this says so where the starving happens.
    """
    global _warned_mixed
    if _warned_mixed or conf.WAKEUPS or not busy.handed_over:
        return
    _warned_mixed = True
    logger.warning(
        "a waiting acquire polls (DISTLOCK_WAKEUPS = False) while other processes queue "
        "with wake-ups on: every release hands the lock to one of them, and this process "
        "may wait until its timeout. Give DISTLOCK_WAKEUPS the same value in every process "
        "that uses the lock database (docs/deployment.md)."
    )


def pause_before_retry(attempt: int, busy: Busy, left: float | None) -> float:
    """Jittered exponential back-off, never past the deadline or the holder's expiry."""
    warn_mixed_wakeups(busy)
    base = float(conf.POLL_INTERVAL) * (2 ** min(attempt, 20))
    pause: float = min(float(conf.POLL_MAX_INTERVAL), base) * random.uniform(0.5, 1.0)
    # Wake just after the holder's lease ends: it is free then even if never released.
    if busy.remaining_us is not None:
        pause = min(pause, busy.remaining_us / 1e6 + 0.001)
    if left is not None:
        pause = min(pause, left)
    return max(pause, 0.0)


def grant_lease(request: Request, started: float, result: Grant) -> Lease:
    """The Lease of a committed grant, announced with ``lock_acquired``.

    ``started`` is the monotonic time before the granting request left: the lease's local
    deadline counts from it, so it never ends later than the database's expiry. The
    signal's ``waited`` is the time from the call to the start of that try (microseconds
    when the first try got the lock): no clock read beyond those the acquire makes anyway.
    """
    alias, seconds, backend = request.alias, request.seconds, request.backend
    if backend is None:
        backend = backend_for(connections[alias])
    lease = Lease._granted(
        request.name, request.owner, result.token, using=alias, ttl=seconds,
        expires_us=result.expires_us - request.delay_us, acquired_us=result.acquired_us,
        holder=request.description, deadline=started + seconds - backend.clock_resolution,
    )
    if request.policies is not None:
        lease.policies = request.policies
    signals.lock_acquired.send(
        sender=Lease, lease=lease, took_over=result.took_over, waited=started - request.began,
    )
    return lease


def block_ended(lease: Lease, held: bool) -> None:
    """After a ``lock``/``alock`` block released ``lease``: say so if it was lost on the way.

    Not raised: the block's work is done by then; fenced writes are what refuse a stale
    holder's writes.
    """
    if not held and not lease.lost:
        logger.warning(
            "lock %r (token %s) was no longer held when its block ended",
            lease.name, lease.token,
        )
        lease._lose("it expired or was taken over before the block ended")
