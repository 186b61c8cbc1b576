"""Read/write locks: readers share a name, a writer holds it alone, and a writer's token
is above every reader's before it.

What a read/write lock guarantees (docs/rwlocks.md):

- **Exclusion by the database clock.** A write lease and any other lease of the name
  never overlap: a writer is granted only when no reader and no writer holds, a reader
  only when no writer holds. At most ``READERS`` (32) readers hold at once.
- **Generations.** Every grant's token is one above every token the name's rows have,
  so a writer's token is above every reader's before it. A fenced write under a read
  lease of an older generation is refused: its row is no longer held by the database
  clock (the writer could only be granted once it was not), and the rows the writer
  wrote carry the writer's higher token.
- **Writers are not starved by readers.** A writer that must wait leaves its *intent* on
  the head row: for ``3 × DISTLOCK_POLL_MAX_INTERVAL`` (renewed at each of its tries) no
  new reader is granted, so the readers holding finish and the writer gets in. Readers
  that already hold are never cut short. A writer that gives up leaves its intent to run
  out.
- Read and write leases are :class:`~distlock.core.shared.Permit` leases of their rows:
  renew, release (owner *and* token), break, expiry and ``is_current()`` are a lock's.

Not re-entrant, and no upgrade: a read or write lock of a name inside a block that
holds one of the same name, here, raises NestedLock at once (a write inside a read would
wait for itself). Rows: ``name#rw`` (the head, never held), ``name#write`` and
``name#read:0`` … ``name#read:31``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from distlock.conf import conf
from distlock.core.blocks import AsyncBlock, Block, SyncBlock
from distlock.core.grants import DEFAULT, Request
from distlock.core.leases import LostCallback
from distlock.core.shared import (
    Permit,
    aobtain,
    async_holder,
    obtain,
    refuse_nested,
)
from distlock.validation import Seconds, check_name

__all__ = [
    "READERS", "aacquire_read", "aacquire_write", "acquire_read", "acquire_write",
    "aread_lock", "awrite_lock", "read_lock", "write_lock",
]

F = TypeVar("F", bound=Callable[..., Any])

#: How many readers may hold one name at once (reader rows).
READERS = 32
#: A waiting writer's intent lasts this many DISTLOCK_POLL_MAX_INTERVALs past its try.
INTENT_POLLS = 3
_FAMILY = ("read", "write")


def row_names(name: str) -> tuple[str, str, list[str]]:
    """(head, writer row, reader rows) of read/write lock ``name``."""
    return f"{name}#rw", f"{name}#write", [f"{name}#read:{index}" for index in range(READERS)]


def check_rw_name(name: object) -> str:
    checked = check_name(name)
    check_name(f"{checked}#read:{READERS}")
    return checked


def _attempt(write: bool) -> Callable[[Request], tuple[str, tuple[Any, ...]]]:
    def attempt(request: Request) -> tuple[str, tuple[Any, ...]]:
        head, writer, readers = row_names(request.name)
        # Only a writer that will wait leaves an intent: one try that gives up at once
        # would keep readers out for nothing.
        waits = write and request.blocking and request.wait != 0
        intent_us = round(INTENT_POLLS * float(conf.POLL_MAX_INTERVAL) * 1e6) if waits else 0
        return "rw_grant", (
            request.name, head, writer, readers, write, request.owner,
            request.description, request.ttl_us, intent_us,
        )
    return attempt


def _request(
    name: str, ttl: Seconds | None, blocking: bool, timeout: Seconds | None,
    using: str | None, holder: str,
) -> Request:
    check_rw_name(name)
    request = Request(name, ttl, blocking, timeout, using, holder)
    refuse_nested(_FAMILY, request.name, request.alias)
    return request


def _acquire(write: bool, name: str, ttl: Seconds | None, blocking: bool,
             timeout: Seconds | None, using: str | None, holder: str, auto_renew: bool,
             on_lost: LostCallback | None) -> Permit | None:
    request = _request(name, ttl, blocking, timeout, using, holder)
    kind = "write" if write else "read"
    return obtain(request, _attempt(write), kind, auto_renew=auto_renew, on_lost=on_lost)


async def _aacquire(write: bool, name: str, ttl: Seconds | None, blocking: bool,
                    timeout: Seconds | None, using: str | None, holder: str,
                    auto_renew: bool, on_lost: LostCallback | None) -> Permit | None:
    request = _request(name, ttl, blocking, timeout, using, async_holder(holder))
    kind = "write" if write else "read"
    return await aobtain(
        request, _attempt(write), kind, auto_renew=auto_renew, on_lost=on_lost
    )


def acquire_read(
    name: str, *, ttl: Seconds | None = None, blocking: bool = True,
    timeout: Seconds | None = DEFAULT, using: str | None = None, holder: str = "",
    auto_renew: bool = False, on_lost: LostCallback | None = None,
) -> Permit | None:
    """A read lease of ``name`` (shared with other readers), or None; acquire()'s options
    and exceptions. Refused while a writer holds or waits (writer preference)."""
    return _acquire(False, name, ttl, blocking, timeout, using, holder, auto_renew, on_lost)


def acquire_write(
    name: str, *, ttl: Seconds | None = None, blocking: bool = True,
    timeout: Seconds | None = DEFAULT, using: str | None = None, holder: str = "",
    auto_renew: bool = False, on_lost: LostCallback | None = None,
) -> Permit | None:
    """The write lease of ``name`` (no reader or other writer holds), or None;
    acquire()'s options and exceptions. Its token is above every reader's before it."""
    return _acquire(True, name, ttl, blocking, timeout, using, holder, auto_renew, on_lost)


async def aacquire_read(
    name: str, *, ttl: Seconds | None = None, blocking: bool = True,
    timeout: Seconds | None = DEFAULT, using: str | None = None, holder: str = "",
    auto_renew: bool = False, on_lost: LostCallback | None = None,
) -> Permit | None:
    """acquire_read() for async code."""
    return await _aacquire(
        False, name, ttl, blocking, timeout, using, holder, auto_renew, on_lost
    )


async def aacquire_write(
    name: str, *, ttl: Seconds | None = None, blocking: bool = True,
    timeout: Seconds | None = DEFAULT, using: str | None = None, holder: str = "",
    auto_renew: bool = False, on_lost: LostCallback | None = None,
) -> Permit | None:
    """acquire_write() for async code."""
    return await _aacquire(
        True, name, ttl, blocking, timeout, using, holder, auto_renew, on_lost
    )


class _RWBlock(Block[Permit]):
    write: bool = False

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
    ) -> None:
        self._keep(check_rw_name(name), {
            "ttl": ttl, "timeout": timeout, "using": using, "holder": holder,
            "auto_renew": auto_renew, "on_lost": on_lost,
        })

    def _take(self) -> Permit | None:
        options = self._options
        return _acquire(
            self.write, self.name, options["ttl"], True, options["timeout"], options["using"],
            options["holder"], options["auto_renew"], options["on_lost"],
        )

    async def _atake(self) -> Permit | None:
        options = self._options
        return await _aacquire(
            self.write, self.name, options["ttl"], True, options["timeout"],
            options["using"], options["holder"], options["auto_renew"], options["on_lost"],
        )


class _SyncRW(_RWBlock, SyncBlock[Permit]):
    """A read or write lock for ``with`` and plain functions."""


class _AsyncRW(_RWBlock, AsyncBlock[Permit]):
    """A read or write lock for ``async with`` and ``async def``."""


class read_lock(_SyncRW):  # noqa: N801 - reads like a function
    """Hold a read lease of ``name`` for a ``with`` block (or a decorated call); shared
    with other readers, refused while a writer holds or waits. LockTimeout if none is
    had within ``timeout``; released when the block ends."""


class write_lock(_SyncRW):  # noqa: N801
    """Hold the write lease of ``name`` for a ``with`` block (or a decorated call): no
    reader or writer holds meanwhile, and its token is above every reader's before it."""

    write = True


class aread_lock(_AsyncRW):  # noqa: N801
    """:class:`read_lock` for ``async with`` and ``async def``."""


class awrite_lock(_AsyncRW):  # noqa: N801
    """:class:`write_lock` for ``async with`` and ``async def``."""

    write = True
