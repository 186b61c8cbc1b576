"""Asking about a lock without taking it: ``lock_status()`` and ``Lease.is_current()``.

Both are plain reads: no row lock, no write, no commit and no rollback, so they may run
inside the caller's ``transaction.atomic()`` (or with autocommit off) on the lock's
database, and they never wait for a transaction that holds the lock row (a fenced write's
ownership check, an acquire in flight). The lock row and the database clock come from one
statement, and the state is judged with that one reading of the clock: ``held`` is true
exactly when ``remaining`` is above 0 (``state_case``, the admin's column, would read the
clock a second time in the row, and at a lease's end the two readings can disagree).

A read is out of date as soon as it arrives: the answer is advice for people and for
choosing what to try, not permission to write. Writes that must not come from a stale
holder are fenced writes, which the database decides in the writing transaction. Inside
a transaction at REPEATABLE READ (MariaDB's default; PostgreSQL's if set) the row is the
one that transaction's snapshot sees, while the clock is read now.

``Lease.is_current()`` is the same kind of read for one grant, by the backend's
``holds`` (no models: :mod:`distlock.core.leases` loads before the app registry, and the
fencing modules that models re-export import it). This module is ``inspection``, not
``inspect``, so as not to read like the standard library's module, which leases.py uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from asgiref.sync import sync_to_async
from django.db import connections

from distlock.backends import backend_for
from distlock.conf import conf
from distlock.core.status import EXPIRED, FREE, HELD, database_now
from distlock.models import Lock
from distlock.times import from_us
from distlock.validation import check_name, check_using

_COLUMNS = ("owner", "holder", "token", "acquired_us", "expires_us", "renew_count")


@dataclass(frozen=True)
class LockStatus:
    """One lock as the database saw it at ``db_now``.

    ``state`` is ``"held"`` (an unexpired lease), ``"expired"`` (the lease ran out by the
    database clock and nobody has taken the lock over yet: the next acquire gets it) or
    ``"free"`` (released, broken, or never locked), as the admin shows it. ``token`` is
    the latest token granted for the name (0 if it was never locked); the next grant gets
    a higher one. ``owner``, ``holder``, ``acquired_at``, ``expires_at`` and ``renewals``
    describe the latest grant while it is held or expired, and are None once the lock is
    free. ``remaining`` is seconds of the lease left by the database clock (0.0 unless
    held). ``waiters`` counts the sessions registered for a wake-up on the name (a
    process, or one event loop for all its coroutines) where the database records them
    (PostgreSQL with ``DISTLOCK_WAKEUPS``); None where it cannot be known (MariaDB,
    SQLite: waiters there poll and register nowhere).
    """

    name: str
    held: bool
    state: str
    holder: str | None
    owner: str | None
    token: int
    acquired_at: datetime | None
    expires_at: datetime | None
    remaining: float
    renewals: int | None
    waiters: int | None
    db_now: datetime


def lock_status(name: str, *, using: str | None = None) -> LockStatus:
    """Lock ``name``'s state by the database clock, read without taking any lock.

    One statement reads the lock row and the database clock; on PostgreSQL a second one
    counts the waiters (a name without a row needs one more, for the clock). Safe inside
    the caller's transaction: it only reads (see the module's notes on snapshots).

    Raises TypeError/ValueError for a bad name or alias, as acquire() does, before any
    SQL.
    """
    name = check_name(name)
    alias = check_using(using)
    row = (
        Lock.objects.using(alias).filter(name=name)
        .annotate(db_now_us=database_now(alias))
        .values_list("db_now_us", *_COLUMNS)
        .first()
    )
    connection = connections[alias]
    backend = backend_for(connection)
    with connection.cursor() as cursor:
        if row is None:
            row = (backend.now(cursor), "", "", 0, None, None, None)
        waiters = (
            backend.waiters(cursor, name)
            if conf.WAKEUPS and backend.supports_wakeups() else None
        )
    now_us, owner, holder, token, acquired_us, expires_us, renewals = row
    state = state_at(owner, expires_us, now_us)
    if state == FREE:
        return LockStatus(
            name=name, held=False, state=FREE, holder=None, owner=None, token=token,
            acquired_at=None, expires_at=None, remaining=0.0, renewals=None,
            waiters=waiters, db_now=from_us(now_us),
        )
    held = state == HELD
    return LockStatus(
        name=name, held=held, state=state, holder=holder, owner=owner, token=token,
        acquired_at=from_us(acquired_us), expires_at=from_us(expires_us),
        remaining=(expires_us - now_us) / 1e6 if held and expires_us is not None else 0.0,
        renewals=renewals, waiters=waiters, db_now=from_us(now_us),
    )


async def alock_status(name: str, *, using: str | None = None) -> LockStatus:
    """lock_status() for async code, run where Django runs its async ORM calls
    (``sync_to_async``, thread-sensitive): inside a request, on the request's connection
    and transaction, as in sync code."""
    return await sync_to_async(lock_status)(name, using=using)


def state_at(owner: str, expires_us: int | None, now_us: int) -> str:
    """:func:`~distlock.core.status.state_case` for one row, at ``now_us`` (one reading
    of the database clock): held until the lease's end, expired from that instant on."""
    if owner == "":
        return FREE
    if expires_us is not None and expires_us > now_us:
        return HELD
    return EXPIRED

