"""Semaphores: at most N holders of a name by the database clock, each permit fenced.

What a semaphore guarantees (docs/semaphores.md):

- **At most N unexpired permits** of a name at any database instant. A grant is one
  transaction that locks the semaphore's head row, counts the permits held by the
  database clock (read after the row locks are held) and refuses at N or more.
- **A fencing token per permit grant, strictly increasing per semaphore name**: each
  grant's token is one above every token the semaphore's rows have, and the head keeps
  the last one.
- **A permit is a lease of its row** (:class:`~distlock.core.shared.Permit`): it renews,
  releases (owner *and* token: a stale holder cannot free someone else's permit), is
  lost, broken and expires like a lock's lease; a holder that dies blocks one permit for
  at most its ttl.
- **Fenced writes accept a permit** for rows guarded by the semaphore's name: such a
  write commits only if the permit's row still has this owner and token, unexpired by the
  database clock, checked inside the writing transaction (and the row's high-water mark
  is at or below the permit's token, as for any lease).
- **Changing N** for a name with holders: a grant counts every permit row the name has
  had. With a smaller N current holders finish and nothing is granted until fewer than
  the new N hold; a larger N takes effect at the next grant.

Rows: ``name#permits`` (the head, never held; its ``holder`` reads ``permits=N``) and
``name#permit:0`` … ``name#permit:<N-1>``. Those suffixes are the semaphore's: the plain
lock entry points refuse such names (:func:`distlock.validation.refuse_reserved`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import connections

from distlock.backends import backend_for
from distlock.core.blocks import AsyncBlock, Block, SyncBlock
from distlock.core.grants import DEFAULT, Request
from distlock.core.inspection import LockStatus, state_at
from distlock.core.leases import LostCallback
from distlock.core.permits import MAX_PERMITS, check_permits
from distlock.core.shared import (
    Permit,
    aobtain,
    async_holder,
    obtain,
    refuse_nested,
)
from distlock.core.status import HELD
from distlock.models import Lock
from distlock.times import from_us
from distlock.validation import Seconds, check_name, check_using

__all__ = [
    "MAX_PERMITS", "Permit", "SemaphoreStatus", "aacquire_permit", "acquire_permit",
    "asemaphore", "asemaphore_status", "semaphore", "semaphore_status",
]

F = TypeVar("F", bound=Callable[..., Any])

_FAMILY = ("permit",)


def head_name(name: str) -> str:
    return f"{name}#permits"


def permit_name(name: str, index: int) -> str:
    return f"{name}#permit:{index}"


def check_semaphore_name(name: object) -> str:
    """A lock name whose permit rows' names fit too (ValueError otherwise)."""
    checked = check_name(name)
    check_name(permit_name(checked, MAX_PERMITS))
    return checked


def _attempt(permits: int) -> Callable[[Request], tuple[str, tuple[Any, ...]]]:
    def attempt(request: Request) -> tuple[str, tuple[Any, ...]]:
        name = request.name
        return "semaphore_grant", (
            name, head_name(name), permit_name(name, 0)[:-1], permits, request.owner,
            request.description, request.ttl_us,
        )
    return attempt


def _request(
    name: str, permits: int, ttl: Seconds | None, blocking: bool, timeout: Seconds | None,
    using: str | None, holder: str,
) -> tuple[Request, int]:
    check_semaphore_name(name)
    count = check_permits(permits)
    request = Request(name, ttl, blocking, timeout, using, holder)
    refuse_nested(_FAMILY, request.name, request.alias)
    return request, count


def acquire_permit(
    name: str,
    *,
    permits: int,
    ttl: Seconds | None = None,
    blocking: bool = True,
    timeout: Seconds | None = DEFAULT,
    using: str | None = None,
    holder: str = "",
    auto_renew: bool = False,
    on_lost: LostCallback | None = None,
) -> Permit | None:
    """Take one of ``permits`` permits of semaphore ``name``; its Permit, or None.

    The options are acquire()'s: one try with ``blocking=False``, otherwise retries with
    back-off until ``timeout`` (default DISTLOCK_DEFAULT_TIMEOUT; None: no limit). Raises
    TypeError/ValueError for bad arguments (``permits`` from 1 to MAX_PERMITS) before any
    SQL, NestedLock inside a ``semaphore()`` block of the same name here,
    TransactionNotAllowed inside ``atomic()`` on the lock's database, TokenExhausted.
    """
    request, count = _request(name, permits, ttl, blocking, timeout, using, holder)
    return obtain(request, _attempt(count), "permit", auto_renew=auto_renew, on_lost=on_lost)


async def aacquire_permit(
    name: str,
    *,
    permits: int,
    ttl: Seconds | None = None,
    blocking: bool = True,
    timeout: Seconds | None = DEFAULT,
    using: str | None = None,
    holder: str = "",
    auto_renew: bool = False,
    on_lost: LostCallback | None = None,
) -> Permit | None:
    """acquire_permit() for async code (waiting never blocks the event loop;
    ``auto_renew`` is an asyncio task; a cancelled caller keeps no permit)."""
    request, count = _request(
        name, permits, ttl, blocking, timeout, using, async_holder(holder)
    )
    return await aobtain(
        request, _attempt(count), "permit", auto_renew=auto_renew, on_lost=on_lost
    )


class _SemaphoreBlock(Block[Permit]):
    def __init__(
        self,
        name: str,
        *,
        permits: int,
        ttl: Seconds | None = None,
        timeout: Seconds | None = DEFAULT,
        using: str | None = None,
        holder: str = "",
        auto_renew: bool = False,
        on_lost: LostCallback | None = None,
    ) -> None:
        checked = check_semaphore_name(name)
        check_permits(permits)
        self._keep(checked, {
            "permits": permits, "ttl": ttl, "timeout": timeout, "using": using,
            "holder": holder, "auto_renew": auto_renew, "on_lost": on_lost,
        })

    def _take(self) -> Permit | None:
        return acquire_permit(self.name, **self._options)

    async def _atake(self) -> Permit | None:
        return await aacquire_permit(self.name, **self._options)


class semaphore(_SemaphoreBlock, SyncBlock[Permit]):  # noqa: N801 - reads like a function
    """Hold one of ``permits`` permits of semaphore ``name`` for a ``with`` block (or a
    decorated function's call).

    ``with semaphore("exports", permits=3, ttl=60, timeout=10) as permit:`` waits up to
    ``timeout`` seconds and raises LockTimeout if no permit can be had. The permit is
    released when the block ends. ``report.save(fence=permit)`` fences rows guarded by
    ``"exports"``. Not re-entrant: a nested ``semaphore()`` of the same name here raises
    NestedLock at once. As a decorator it refuses ``async def`` functions
    (``asemaphore`` is the async form).
    """


class asemaphore(_SemaphoreBlock, AsyncBlock[Permit]):  # noqa: N801
    """:class:`semaphore` for ``async with`` blocks and ``async def`` functions."""


@dataclass(frozen=True)
class SemaphoreStatus:
    """A semaphore as the database saw it at ``db_now``.

    ``permits`` is the N of the last grant (None if it never granted one), ``held`` how
    many permits are held by the database clock, ``token`` the last token granted (0:
    none), ``holders`` the :class:`~distlock.LockStatus` of each held permit row.
    """

    name: str
    permits: int | None
    held: int
    token: int
    holders: tuple[LockStatus, ...]
    db_now: datetime


def semaphore_status(name: str, *, using: str | None = None) -> SemaphoreStatus:
    """Semaphore ``name``'s permits by the database clock, read without taking any lock
    (two plain reads; safe inside the caller's transaction, as lock_status())."""
    name = check_semaphore_name(name)
    alias = check_using(using)
    connection = connections[alias]
    head = Lock.objects.using(alias).filter(name=head_name(name)).first()
    count = 0 if head is None else head.renew_count
    names = [permit_name(name, index) for index in range(count)]
    rows = list(Lock.objects.using(alias).filter(name__in=names)) if names else []
    with connection.cursor() as cursor:
        now_us = backend_for(connection).now(cursor)
    holders = []
    for row in sorted(rows, key=lambda row: row.acquired_us or 0):
        if state_at(row.owner, row.expires_us, now_us) != HELD:
            continue
        assert row.expires_us is not None
        holders.append(LockStatus(
            name=row.name, held=True, state=HELD, holder=row.holder, owner=row.owner,
            token=row.token, acquired_at=from_us(row.acquired_us),
            expires_at=from_us(row.expires_us), remaining=(row.expires_us - now_us) / 1e6,
            renewals=row.renew_count, waiters=None, db_now=from_us(now_us),
        ))
    permits = None
    if head is not None and head.holder.startswith("permits="):
        permits = int(head.holder.removeprefix("permits="))
    return SemaphoreStatus(
        name=name, permits=permits, held=len(holders),
        token=0 if head is None else head.token, holders=tuple(holders),
        db_now=from_us(now_us),
    )


async def asemaphore_status(name: str, *, using: str | None = None) -> SemaphoreStatus:
    """semaphore_status() for async code."""
    return await sync_to_async(semaphore_status)(name, using=using)
