"""lock_all() and acquire_all(): several lock names held at once (async twins:
:mod:`distlock.core.async_groups`).

What a group guarantees:

- **All or nothing.** Every name is granted, or none is held when the call returns or
  raises: a name that cannot be had before the deadline makes the names already taken
  be released (an exception or a cancellation on the way does the same).
- **One canonical order.** The names are checked, refused if repeated, and taken in the
  order of their exact UTF-8 bytes, whatever order the caller gave. Two callers with the
  same set in different orders therefore never deadlock.
- **One lease per name.** Each member is an ordinary :class:`~distlock.core.leases.Lease`
  of its own name with its own fencing token: it renews, releases, is lost and broken
  on its own, and ``save(fence=group[name])`` is a fenced write under that name's lock.

Waiting holds the names taken so far (the alternative was to release them all, wait
for the busy name and start again). Holding in order is deadlock-free because every
caller waits only for a name that sorts after everything it holds, so waits never form
a cycle; it also cannot livelock (two callers releasing and retrying in step), burns no
tokens on grants given straight back, and keeps each name's FIFO of waiters. The price:
names that sort before the busy one stay held while waiting, as with ordered row locks.
If the wait made an earlier lease run short (less than half its ttl left), it is renewed
once the last name is granted (same token); if it lapsed meanwhile, everything taken is
released and the group starts again within the same timeout.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ContextDecorator
from types import TracebackType
from typing import Any, TypeVar

from distlock.core.blocks import _current, _Held, _running_task, refuse_async
from distlock.core.grants import DEFAULT, block_ended, wait_limit
from distlock.core.leases import Lease, LostCallback
from distlock.core.locks import acquire, refuse_nested
from distlock.exceptions import LockLost, LockTimeout
from distlock.validation import Seconds, check_lock_name, check_text, check_ttl, check_using

F = TypeVar("F", bound=Callable[..., Any])


class LeaseGroup(Mapping[str, Lease]):
    """The leases of one ``lock_all``/``acquire_all`` grant, by name in canonical order.

    ``group[name]`` is that name's Lease (pass it as ``fence=``); iterating gives the
    names. ``release()`` and ``renew()`` act on every member, going on past a failure.
    """

    def __init__(self, leases: Iterable[Lease]) -> None:
        self._leases = {lease.name: lease for lease in leases}

    def __getitem__(self, name: str) -> Lease:
        return self._leases[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._leases)

    def __len__(self) -> int:
        return len(self._leases)

    def __repr__(self) -> str:
        return f"<LeaseGroup tokens={self.tokens!r}>"

    @property
    def leases(self) -> tuple[Lease, ...]:
        """The member leases, in canonical order."""
        return tuple(self._leases.values())

    @property
    def tokens(self) -> dict[str, int]:
        """Each name's fencing token."""
        return {name: lease.token for name, lease in self._leases.items()}

    @property
    def lost(self) -> bool:
        """True once any member lease is known to be lost."""
        return any(lease.lost for lease in self._leases.values())

    def remaining(self) -> float:
        """Seconds left by the local clock for the member that ends first."""
        return min(lease.remaining() for lease in self._leases.values())

    def renew(self, ttl: Seconds | None = None) -> None:
        """Renew every member (tokens kept). Each is tried; the first LockLost (or other
        error) is raised afterwards, with the others as notes."""
        seconds = None if ttl is None else check_ttl(ttl)
        _each(self.leases, lambda lease: lease.renew(seconds))

    def release(self) -> bool:
        """Release every member, going on past a failure; True if all were still held.

        An error releasing one (its row is then freed by its ttl) is raised after the
        others were released, with any further errors as notes.
        """
        results: list[bool] = []
        _each(self.leases, lambda lease: results.append(lease.release()))
        return all(results)

    async def arenew(self, ttl: Seconds | None = None) -> None:
        """renew() for async code."""
        seconds = None if ttl is None else check_ttl(ttl)
        await _aeach(self.leases, lambda lease: lease.arenew(seconds))

    async def arelease(self) -> bool:
        """release() for async code; each member's release is shielded from cancellation."""
        results: list[bool] = []

        async def one(lease: Lease) -> None:
            results.append(await lease.arelease())

        await _aeach(self.leases, one)
        return all(results)


def _raise_first(errors: list[BaseException]) -> None:
    if errors:
        first = errors[0]
        for other in errors[1:]:
            first.add_note(f"also failed: {other!r}")
        raise first


def _each(leases: Iterable[Lease], action: Any) -> None:
    errors: list[BaseException] = []
    for lease in leases:
        try:
            action(lease)
        except Exception as exc:  # noqa: BLE001 - raised after the others were done
            errors.append(exc)
    _raise_first(errors)


async def _aeach(leases: Iterable[Lease], action: Any) -> None:
    errors: list[BaseException] = []
    for lease in leases:
        try:
            await action(lease)
        except Exception as exc:  # noqa: BLE001 - raised after the others were done
            errors.append(exc)
    _raise_first(errors)


def canonical_names(names: object) -> tuple[str, ...]:
    """The lock names of ``names``, checked, sorted by their exact UTF-8 bytes.

    Raises TypeError for a single str (or bytes) or a non-iterable, ValueError for an
    empty collection or a repeated name, and what ``acquire`` raises for a bad name.
    """
    if isinstance(names, str | bytes | bytearray):
        raise TypeError(
            f"names must be a collection of lock names, not a single {type(names).__name__}"
            " (write [name] for one)"
        )
    if not isinstance(names, Iterable):
        raise TypeError(f"names must be a collection of lock names, not {type(names).__name__}")
    checked = [check_lock_name(name) for name in names]
    if not checked:
        raise ValueError("names must hold at least one lock name")
    repeated = sorted(name for name, count in Counter(checked).items() if count > 1)
    if repeated:
        raise ValueError(f"lock names must not repeat: {repeated!r}")
    return tuple(sorted(checked, key=lambda name: name.encode("utf-8")))


class _Plan:
    """One group request, checked before any SQL (as acquire's Request is)."""

    def __init__(
        self, names: object, ttl: Seconds | None, blocking: bool, timeout: Seconds | None,
        using: str | None, holder: str,
    ) -> None:
        self.names = canonical_names(names)
        check_ttl(ttl)
        wait = wait_limit(timeout)
        if not isinstance(blocking, bool):
            raise TypeError(f"blocking must be a bool, not {type(blocking).__name__}")
        check_text(holder, "holder")
        self.alias = check_using(using)
        self.wait = wait if blocking else 0.0
        self.give_up: float | None = None
        self.options: dict[str, Any] = {"ttl": ttl, "using": self.alias, "holder": holder}
        self.refused = self.names[0]

    def start(self) -> _Plan:
        """NestedLock before any name is taken; the group's deadline starts now."""
        for name in self.names:
            refuse_nested(name, self.alias)
        self.give_up = None if self.wait is None else time.monotonic() + self.wait
        return self

    def left(self) -> float | None:
        """The timeout for the next name: what is left of the group's (0: one try)."""
        return None if self.give_up is None else max(0.0, self.give_up - time.monotonic())


def _take(plan: _Plan, auto_renew: bool, on_lost: LostCallback | None) -> LeaseGroup | None:
    while True:
        taken: list[Lease] = []
        try:
            for name in plan.names:
                lease = acquire(
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
                        lease.renew()
                return LeaseGroup(taken)
        except LockLost:
            pass  # an earlier lease lapsed while waiting: start again
        except BaseException:
            _give_back(taken)
            raise
        _give_back(taken)
        if len(taken) < len(plan.names) or plan.left() == 0:
            return None


def _give_back(taken: list[Lease]) -> None:
    for lease in taken:
        with contextlib.suppress(Exception):  # its ttl frees it then
            lease.release()


# acquire_all and lock_all repeat acquire()'s keywords on purpose: a public signature is
# written out for help(), IDEs and type checkers; the arguments are checked once, in _Plan.
def acquire_all(
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
    """Acquire every lock in ``names`` and return their :class:`LeaseGroup`, or None.

    A LeaseGroup rather than a list or a single lease: each name keeps its own token, so
    a fenced write needs the member of its own name (``group[name]``), and the group
    releases and renews its members together. None (like ``acquire``) when the group
    cannot be had: with ``blocking=False`` each name gets one try; otherwise ``timeout``
    (default ``DISTLOCK_DEFAULT_TIMEOUT``; None: no limit) is the whole group's. Either
    way nothing is held when it returns None. Order and waiting: see the module docstring.
    The options mean what they mean for ``acquire``, applied to each name.

    Raises TypeError/ValueError for bad arguments (see :func:`canonical_names`) before
    any SQL, NestedLock at once if a ``lock()``/``lock_all()`` block running here holds
    one of the names, and whatever ``acquire`` raises (after giving back what it took).
    """
    plan = _Plan(names, ttl, blocking, timeout, using, holder).start()
    return _take(plan, auto_renew, on_lost)


class _GroupBlock:
    """What ``lock_all`` and ``alock_all`` share: checked options and the lease stack."""

    def __init__(
        self,
        names: Iterable[str],
        *,
        ttl: Seconds | None = None,
        timeout: Seconds | None = DEFAULT,
        using: str | None = None,
        holder: str = "",
        auto_renew: bool = False,
        on_lost: LostCallback | None = None,
    ) -> None:
        # Checked now, so a bad decorator fails at import, not at its first call.
        self._plan = _Plan(names, ttl, True, timeout, using, holder)
        self._options: dict[str, Any] = {
            "ttl": ttl, "timeout": timeout, "using": using, "holder": holder,
            "auto_renew": auto_renew, "on_lost": on_lost,
        }
        self.group: LeaseGroup | None = None
        self._token: Any = None

    @property
    def _renewal(self) -> tuple[bool, LostCallback | None]:
        return self._options["auto_renew"], self._options["on_lost"]

    def _recreate_cm(self) -> Any:
        # A decorated function may run in several threads (or tasks) at once.
        return type(self)(self._plan.names, **self._options)

    def _entered(self, plan: _Plan, group: LeaseGroup | None) -> LeaseGroup:
        if group is None:
            raise LockTimeout(plan.refused, plan.wait)
        self.group = group
        task = _running_task()
        held: _Held = (*_current.get(), *((lease, task) for lease in group.leases))
        self._token = _current.set(held)
        return group

    def _leaving(self) -> LeaseGroup | None:
        group, self.group = self.group, None
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        return group


def _end_one(lease: Lease) -> None:
    block_ended(lease, lease.release())


class lock_all(_GroupBlock, ContextDecorator):  # noqa: N801 - reads like a function
    """Hold every lock in ``names`` for a ``with`` block: all or nothing, canonical order.

    ``with lock_all(["account:1", "account:2"], ttl=30, timeout=10) as group:`` gives a
    :class:`LeaseGroup`; ``group["account:1"]`` fences writes to that account. Raises
    LockTimeout (naming the name that was busy) if the whole group cannot be had within
    ``timeout``, holding none of it. Every member is released when the block ends, also
    on an exception; a failed release does not stop the others and is raised after them.
    Inside the block ``lock()``/``lock_all()`` of a member name raises NestedLock at once,
    and ``current_lease()`` is the last member in canonical order.
    """

    def __call__(self, func: F) -> F:
        """Decorate ``func``; a coroutine or async generator function is refused."""
        refuse_async(func, "@lock_all(...)")
        return super().__call__(func)

    def __enter__(self) -> LeaseGroup:
        plan = self._plan.start()
        return self._entered(plan, _take(plan, *self._renewal))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        group = self._leaving()
        if group is not None:
            _each(group.leases, _end_one)
