"""The Lease: what a holder gets for one grant of a lock."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime

from asgiref.sync import sync_to_async
from django.db import connections, transaction

from distlock import db, signals
from distlock.backends import backend_for
from distlock.backends.results import Grant
from distlock.core import uncommitted
from distlock.core.background import AsyncRenewer, DeferredRelease, Renewer, ThreadRenewer
from distlock.core.policies import Policies
from distlock.core.shielding import shielded
from distlock.exceptions import LockLost
from distlock.times import from_us
from distlock.validation import check_name, check_owner, check_token, check_ttl, check_using
from distlock.waiting import queue as wakeups

logger = logging.getLogger("distlock")

# Its return value is ignored (an awaitable one is awaited by the async renewer), so any
# callable of (lease, exc) fits.
LostCallback = Callable[["Lease", BaseException | str], object]


# A time as the database gave it (epoch microseconds), or already as a datetime.
Moment = int | datetime | None


def _moment(value: Moment) -> datetime | None:
    return from_us(value) if isinstance(value, int) else value


class Lease:
    """One grant of a lock: its fencing token, owner id and expiry.

    ``token`` is strictly greater than every token granted earlier for ``name``; pass the
    lease to fenced writes so the database can refuse them once the lease is stale.
    ``expires_at`` is the database's view; :meth:`remaining` is the holder's own, started
    before the acquire request left, so it never ends later than the database's — as long
    as this host's clock runs no slower than the database server's (see there).
    ``policies`` are the grant's lease policies (docs/lease-policies.md), None without.
    """

    #: The grant's min_hold/max_hold/lock_delay (None: none, the common case).
    policies: Policies | None = None

    def __init__(
        self, name: str, owner: str, token: int, *, using: str, ttl: float,
        expires_at: datetime | None = None, acquired_at: datetime | None = None,
        holder: str = "", deadline: float | None = None,
    ) -> None:
        self._set(
            check_name(name), check_owner(owner), check_token(token), check_using(using),
            check_ttl(ttl), expires_at, acquired_at, holder, deadline,
        )

    @classmethod
    def _granted(
        cls, name: str, owner: str, token: int, *, using: str, ttl: float,
        expires_us: int, acquired_us: int, holder: str, deadline: float,
    ) -> Lease:
        """The lease of a grant acquire() just got: every value was checked on the way in
        or comes from the database, so the public constructor's checks are skipped."""
        lease = cls.__new__(cls)
        lease._set(name, owner, token, using, ttl, expires_us, acquired_us, holder, deadline)
        return lease

    def _set(
        self, name: str, owner: str, token: int, using: str, ttl: float,
        expires: Moment, acquired: Moment, holder: str, deadline: float | None,
    ) -> None:
        self.name = name
        self.owner = owner
        self.token = token
        self.using = using
        self.ttl = ttl
        # Database microseconds until someone reads them as datetimes (see _moment).
        self._expires = expires
        self._acquired = acquired
        self._released_at: Moment = None
        self.holder = holder
        # A lease built by hand (not by acquire) makes no claim to time left.
        self._deadline = time.monotonic() if deadline is None else deadline
        self._mutex = threading.Lock()
        self._lost_reason: str | None = None
        self._released = False
        self._renewer: Renewer | None = None

    # The grant's times as the database gave them (epoch microseconds), turned into aware
    # datetimes when first read: most leases are released without anyone reading them,
    # and three datetimes were a measurable part of a cycle's client CPU. Three plain
    # properties, alike, rather than a descriptor: each keeps its own docstring and type.

    @property
    def expires_at(self) -> datetime | None:
        """When the lease ends by the database clock (as of the grant or last renewal)."""
        self._expires = value = _moment(self._expires)
        return value

    @expires_at.setter
    def expires_at(self, value: datetime | None) -> None:
        self._expires = value

    @property
    def acquired_at(self) -> datetime | None:
        """When the database granted the lease."""
        self._acquired = value = _moment(self._acquired)
        return value

    @acquired_at.setter
    def acquired_at(self, value: datetime | None) -> None:
        self._acquired = value

    @property
    def released_at(self) -> datetime | None:
        """When the database released it (None before the release, or if it was no longer
        held then)."""
        self._released_at = value = _moment(self._released_at)
        return value

    @released_at.setter
    def released_at(self, value: datetime | None) -> None:
        self._released_at = value

    def __repr__(self) -> str:
        return f"<Lease {self.name!r} token={self.token} owner={self.owner[:8]}…>"

    @property
    def guard_name(self) -> str:
        """The lock name that guards the rows this lease may fence: its own ``name``; a
        permit of a semaphore or read/write lock answers that lock's name instead, while
        its ownership check reads its own row (distlock/core/shared.py)."""
        return self.name

    @property
    def lost(self) -> bool:
        """True once the lease is known to be gone (a failed renewal or a refused write)."""
        return self._lost_reason is not None

    def remaining(self) -> float:
        """Seconds left by the holder's local monotonic clock (conservative; 0 when over).

        Conservative because the timer started before the acquire request left, so
        network and server latency only shorten it — *assuming this host's monotonic
        clock runs no slower than the database server's clock*. A local clock running at
        a fraction ``f`` of the database's rate overestimates the time left by up to
        ``ttl * (1 - f)`` at the end of the lease (under ``faketime`` x0.5 a 2 s lease
        still shows about 1 s left when the database expires it). Nothing local can
        correct that without a second clock source, so it is a stated assumption, not a
        check: clocks kept by NTP differ in rate by parts per million (microseconds per
        minute of ttl). A renewal starts the count again. Expiry itself is judged by the
        database clock only, and fenced writes refuse a stale holder either way.
        """
        if self._lost_reason is not None or self._released:
            return 0.0
        return max(0.0, self._deadline - time.monotonic())

    def check(self) -> None:
        """Raise LockLost unless the lease is still held by the local clock."""
        if self._lost_reason is not None:
            raise LockLost(self.name, self.token, self._lost_reason)
        if self._released:
            raise LockLost(self.name, self.token, "it was released")
        if self.remaining() <= 0:
            raise LockLost(self.name, self.token, "its ttl ran out")

    def is_current(self) -> bool:
        """True if this grant (owner *and* token) still holds the lock by the database
        clock: not expired, released, broken or taken over.

        A plain read in one statement, as :func:`~distlock.lock_status` is: no row lock,
        so it never waits and may run inside your transaction; it changes nothing (a
        False does not mark the lease lost). The answer is advice, out of date as soon
        as it arrives: a write that must not come from a stale holder is a fenced write.
        """
        # The backend's read, on the alias's own connection: not db.run(), which refuses
        # to run inside the caller's transaction (and opens one of its own).
        connection = connections[self.using]
        with connection.cursor() as cursor:
            held: bool = backend_for(connection).holds(cursor, self.name, self.owner, self.token)
        return held

    async def ais_current(self) -> bool:
        """is_current() for async code (see :meth:`arenew`)."""
        return await sync_to_async(self.is_current)()

    def renew(self, ttl: float | None = None) -> None:
        """Extend the lease to ``ttl`` seconds from now (default: the ttl it was granted).

        The token stays the same. Raises LockLost if the lease expired, was released or
        broken, or another owner holds the lock; the lease is then marked lost.
        """
        seconds = self.ttl if ttl is None else check_ttl(ttl)
        uncommitted.refuse_if_holding(self.name, self.using, f"renewing lock {self.name!r}")
        with self._mutex:
            if self._released:
                raise LockLost(self.name, self.token, "it was released")
            if self._lost_reason is not None:
                raise LockLost(self.name, self.token, self._lost_reason)
            started = time.monotonic()
            policies = self.policies
            result: Grant | str
            if policies is None:
                result = db.run(
                    self.using, "renew", self.name, self.owner, self.token, round(seconds * 1e6)
                )
            else:
                result = self._renew_with(policies, round(seconds * 1e6))
            if isinstance(result, str):
                self._lose(result)
                raise LockLost(self.name, self.token, result)
            resolution = backend_for(connections[self.using]).clock_resolution
            self.ttl = seconds
            if policies is not None:
                # A renewal capped by max_hold grants less than asked.
                seconds = min(seconds, (result.expires_us - result.acquired_us) / 1e6)
            self._deadline = started + seconds - resolution
            self._expires = result.expires_us
        signals.lock_renewed.send(sender=Lease, lease=self)

    def release(self) -> bool:
        """Free the lock. True if this lease still held it; never frees another's grant.

        Releasing twice, or after the lease expired or was taken over, is a no-op that
        returns False. Called while this thread's own transaction still holds fenced
        writes made with the lease (``atomic()`` around the ``lock()`` block, with the lock
        table on its own ``DISTLOCK_DATABASE`` connection), the release is deferred to the
        end of that transaction, which holds the lock row until then: it happens at the
        commit, before ``atomic()`` returns, or moments after a rollback. It then returns
        whether the lease was still held when called.
        """
        notes = uncommitted.holding(self.name, self.using)
        if notes:
            return self._release_after(notes)
        self._stop_renewer()
        with self._mutex:
            if self._released:
                return False
            held, released_us = self._release_in_database()
            # Only now: a release that failed (database down) may be tried again.
            self._released = True
        self._released_by_database(held, released_us)
        return held

    def _renew_with(self, policies: Policies, ttl_us: int) -> Grant | str:
        """A renewal under lease policies: the row's expiry carries the lock-delay, and
        ``max_hold`` caps it (and refuses it once reached). The Grant's expiry is the
        holder's, without the delay."""
        delay_us, most_us = policies.delay_us, policies.max_hold_us
        result: Grant | str
        if most_us is None:
            result = db.run(
                self.using, "renew", self.name, self.owner, self.token, ttl_us + delay_us
            )
        else:
            result = db.run(
                self.using, "renew_within", self.name, self.owner, self.token,
                ttl_us, most_us, delay_us,
            )
        if isinstance(result, str):
            return result
        return Grant(result.token, result.acquired_us, result.expires_us - delay_us)

    def _release_in_database(self) -> tuple[bool, int | None]:
        """The release's one operation (two under a ``min_hold`` that has run out): (was it
        held, when it ends by the database clock). Under a ``min_hold`` not run out yet the
        grant is kept, owner and token, until ``acquired + min_hold``, which it returns."""
        policies = self.policies
        if policies is not None:
            least_us = policies.min_hold_us
            if least_us is not None:
                kept: int | None = db.run(
                    self.using, "keep_until_min_hold", self.name, self.owner, self.token,
                    least_us,
                )
                if kept is not None:
                    return True, kept
        released: tuple[bool, int | None] = db.run(
            self.using, "release", self.name, self.owner, self.token
        )
        return released

    async def arenew(self, ttl: float | None = None) -> None:
        """renew() for async code, run as Django runs its async ORM calls (sync_to_async,
        thread-sensitive): on the same connection, with the same checks, as in sync code.

        Shielded: a cancellation of the awaiting task lets the renewal finish (so the
        lease's state is known) and is raised then (distlock/core/shielding.py)."""
        await shielded(sync_to_async(self.renew)(ttl))

    async def arelease(self) -> bool:
        """release() for async code (see :meth:`arenew`). Shielded the same way: a
        cancellation of the awaiting task lets the release finish, then is raised, so the
        lock is free (or known not held) by the time the CancelledError arrives."""
        return await shielded(sync_to_async(self.release)())

    def _released_by_database(self, held: bool, released_us: int | None) -> None:
        self._released_at = released_us
        wakeups.poke(self.using, self.name)
        signals.lock_released.send(sender=Lease, lease=self, held=held)

    def _release_after(self, notes: list[uncommitted.Note]) -> bool:
        """Release once this thread's open transaction lets go of the lock row.

        A helper thread runs the release on its own connection; it waits for the row lock
        of the caller's fenced writes, so it goes through as soon as that transaction ends,
        whether by commit or by rollback. At a commit the caller also waits for it (an
        ``on_commit`` callback, bounded by the ttl), so after ``atomic()`` the lock is free.
        """
        # Not under self._mutex: a renewal in flight holds it while it waits for the same
        # row lock, so taking it here would wait for this thread's own transaction.
        if self._released:
            return False
        # Read first: if the database cannot be reached, nothing has changed yet.
        held: bool = db.run(self.using, "holds", self.name, self.owner, self.token)
        self._released = True
        # Stopped but not joined, for the same reason; the helper joins it.
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.stopped.set()
        helper = DeferredRelease(self, renewer)
        helper.start()
        for note in notes:
            if note.connection.in_atomic_block:
                transaction.on_commit(
                    functools.partial(helper.join, self.ttl), using=note.connection.alias
                )
        return held

    def start_auto_renew(self, on_lost: LostCallback | None = None) -> None:
        """Renew in a helper thread every ``DISTLOCK_RENEW_FRACTION`` of the ttl.

        The thread has its own database connection. On any failure the lease is marked
        lost, ``on_lost(lease, exc)`` is called and the thread stops; it also stops on
        release.
        """
        if self._renewer is not None:
            raise RuntimeError("auto-renew is already running for this lease")
        self._renewer = ThreadRenewer(self, on_lost)
        self._renewer.start()

    def start_auto_arenew(self, on_lost: LostCallback | None = None) -> None:
        """Renew in an asyncio task of the running loop (no thread), as start_auto_renew.

        ``on_lost(lease, exc)`` may be a plain function or a coroutine function.
        """
        if self._renewer is not None:
            raise RuntimeError("auto-renew is already running for this lease")
        self._renewer = AsyncRenewer(self, on_lost)

    def _stop_renewer(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is not None:
            renewer.stop()

    def _lose(self, reason: str) -> None:
        if self._lost_reason is None:
            self._lost_reason = reason
            logger.warning("lost lock %r (token %s): %s", self.name, self.token, reason)
            signals.lock_lost.send(sender=Lease, lease=self, reason=reason)
