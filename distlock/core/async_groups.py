"""aacquire_all() and alock_all(): :mod:`distlock.core.groups` for async code.

The same plan, order and guarantees as the sync twins, with each name taken by
``aacquire`` (waiting never blocks the event loop). A cancellation while waiting gives
back the names taken so far (each release shielded) before it goes on.

The loop of :func:`_atake` and the signatures below repeat the sync twins' with
``await``: Python cannot share one body between a sync and an async loop, and a public
signature must be written out for help(), IDEs and type checkers. What can be shared is:
the plan (names checked, ordered and timed once: ``_Plan``), the group, and the release.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AsyncContextDecorator
from types import TracebackType
from typing import Any, TypeVar

from asgiref.sync import sync_to_async

from distlock.core.async_locks import aacquire
from distlock.core.blocks import refuse_sync
from distlock.core.grants import DEFAULT
from distlock.core.groups import LeaseGroup, _aeach, _end_one, _GroupBlock, _Plan
from distlock.core.leases import Lease, LostCallback
from distlock.core.shielding import shielded
from distlock.exceptions import LockLost
from distlock.validation import Seconds

AF = TypeVar("AF", bound=Callable[..., Awaitable[Any]])


async def _atake(plan: _Plan, auto_renew: bool, on_lost: LostCallback | None) -> LeaseGroup | None:
    while True:
        taken: list[Lease] = []
        try:
            for name in plan.names:
                lease = await aacquire(
                    name, timeout=plan.left(), auto_renew=auto_renew, on_lost=on_lost,
                    **plan.options,
                )
                if lease is None:
                    plan.refused = name
                    break
                taken.append(lease)
            else:
                for lease in taken[:-1]:
                    if lease.remaining() < lease.ttl / 2:
                        await lease.arenew()
                return LeaseGroup(taken)
        except LockLost:
            pass
        except BaseException:
            await _agive_back(taken)
            raise
        await _agive_back(taken)
        if len(taken) < len(plan.names) or plan.left() == 0:
            return None


async def _agive_back(taken: list[Lease]) -> None:
    for lease in taken:
        with contextlib.suppress(Exception):
            await lease.arelease()  # shielded: a cancellation waits for it, then goes on


async def aacquire_all(
    names: Iterable[str],
    *,
    ttl: Seconds | None = None,
    blocking: bool = True,
    timeout: Seconds | None = DEFAULT,
    using: str | None = None,
    holder: str = "",
    auto_renew: bool = False,
    on_lost: LostCallback | None = None,
) -> LeaseGroup | None:
    """acquire_all() for async code: the same arguments, results and exceptions. A
    cancellation while waiting releases what was taken before it goes on."""
    plan = _Plan(names, ttl, blocking, timeout, using, holder).start()
    return await _atake(plan, auto_renew, on_lost)


class alock_all(_GroupBlock, AsyncContextDecorator):  # noqa: N801 - reads like a function
    """lock_all() for ``async with`` (and ``async def`` functions as a decorator).

    Waits without blocking the event loop; a cancellation while waiting gives back what
    was taken, and the release at the end is shielded from cancellation per member.
    """

    def __call__(self, func: AF) -> AF:
        """Decorate the coroutine function ``func``; a plain function is refused."""
        refuse_sync(func, "@alock_all(...)")
        return super().__call__(func)

    async def __aenter__(self) -> LeaseGroup:
        plan = self._plan.start()
        return self._entered(plan, await _atake(plan, *self._renewal))

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        group = self._leaving()
        if group is not None:
            # In the sync layer, as alock's: a lost-lease signal may write (the audit).
            await _aeach(group.leases, lambda lease: shielded(sync_to_async(_end_one)(lease)))
