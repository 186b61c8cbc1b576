"""The blocks that hold one lease: ``with``, ``async with`` and the decorator forms of
``lock``/``alock``, ``semaphore``/``asemaphore`` and the read/write locks.

They differ only in how a lease is taken (``_take`` / ``_atake``, and the options checked
at construction); the rest is here, once: the stack of leases that ``current_lease()``
reads (a ContextVar, so each thread and each asyncio task sees its own), LockTimeout when
no lease is had, the release as the block ends (shielded from a cancellation in async
code), one block object per call of a decorated function, and the refusal of a function
of the wrong kind at decoration.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Awaitable, Callable
from contextlib import AsyncContextDecorator, ContextDecorator
from types import TracebackType
from typing import Any, Generic, TypeVar

from asgiref.sync import iscoroutinefunction, sync_to_async

from distlock.core import grants
from distlock.core.grants import block_ended
from distlock.core.leases import Lease
from distlock.core.shielding import shielded
from distlock.exceptions import LockTimeout
from distlock.validation import check_text, check_ttl, check_using

L = TypeVar("L", bound=Lease)
F = TypeVar("F", bound=Callable[..., Any])
AF = TypeVar("AF", bound=Callable[..., Awaitable[Any]])

# The leases of the blocks running here, innermost last, each with the asyncio task that
# entered its block (None: sync code outside any task).
_Held = tuple[tuple[Lease, asyncio.Task[Any] | None], ...]
_current: contextvars.ContextVar[_Held] = contextvars.ContextVar("distlock_leases", default=())


def _running_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no event loop runs in this thread
        return None


def _push(lease: Lease) -> contextvars.Token[_Held]:
    """Put ``lease`` on top of this thread's (or task's) stack of current leases."""
    return _current.set((*_current.get(), (lease, _running_task())))


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
        "and released around creating it, not around running it. Use the async API "
        "(alock/alocked) in async code, or call the sync lock inside sync_to_async."
    )


def refuse_sync(func: object, decorator: str) -> None:
    """Raise TypeError unless ``func`` is a coroutine function: an async lock cannot be
    held around a plain call without an event loop to wait in."""
    if not iscoroutinefunction(func):
        what = getattr(func, "__qualname__", repr(func))
        raise TypeError(
            f"{decorator} guards async def functions, and {what}() is not one: use the "
            "sync lock (lock/locked) for plain functions."
        )


def _end_block(lease: Lease) -> None:
    block_ended(lease, lease.release())


class Block(Generic[L]):
    """A block's name and checked options, and what it holds while it runs.

    A subclass's ``__init__`` checks the name and its own options, then hands them all
    to :meth:`_keep`, which checks the common ones: everything is checked at
    construction, so a bad decorator fails at import, not at its first call. The subclass
    also says how a lease is taken (``_take`` for the sync form, ``_atake`` for the async
    one).
    """

    name: str
    _options: dict[str, Any]

    def _keep(self, name: str, options: dict[str, Any]) -> None:
        """Check the options every block has (ttl, timeout, holder, using) and keep them
        with ``name`` (already checked): ``options`` are the keyword arguments
        ``__init__`` takes besides the name, each entry's ``_take`` passes them on."""
        check_ttl(options["ttl"])
        grants.wait_limit(options["timeout"])
        check_text(options["holder"], "holder")
        if options["using"] is not None:
            check_using(options["using"])
        self.name = name
        self._options = options
        self.lease: L | None = None
        self._token: contextvars.Token[_Held] | None = None

    def _recreate_cm(self) -> Any:
        # A decorated function may run in several threads (or tasks) at once: one block
        # object each, made as the first was.
        make: Callable[..., Block[L]] = type(self)
        return make(self.name, **self._options)

    def _take(self) -> L | None:
        raise NotImplementedError

    async def _atake(self) -> L | None:
        raise NotImplementedError

    def _entered(self, lease: L | None) -> L:
        if lease is None:
            raise LockTimeout(self.name, grants.wait_limit(self._options["timeout"]))
        self.lease = lease
        self._token = _push(lease)
        return lease

    def _leaving(self) -> L | None:
        lease, self.lease = self.lease, None
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        return lease


class SyncBlock(Block[L], ContextDecorator):
    """``with`` and the decorator of plain functions (``async def`` is refused)."""

    def __call__(self, func: F) -> F:
        """Decorate ``func``; a coroutine or async generator function is refused."""
        refuse_async(func, f"@{type(self).__name__}(...)")
        return super().__call__(func)

    def __enter__(self) -> L:
        return self._entered(self._take())

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease = self._leaving()
        if lease is None:
            return
        _end_block(lease)


class AsyncBlock(Block[L], AsyncContextDecorator):
    """``async with`` and the decorator of ``async def`` functions (others are refused)."""

    def __call__(self, func: AF) -> AF:
        """Decorate the coroutine function ``func``; a plain function is refused."""
        refuse_sync(func, f"@{type(self).__name__}(...)")
        return super().__call__(func)

    async def __aenter__(self) -> L:
        return self._entered(await self._atake())

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease = self._leaving()
        if lease is not None:
            # Shielded: the release finishes even if the task is cancelled meanwhile, and
            # then that cancellation goes on (raised here, not swallowed).
            await shielded(sync_to_async(_end_block)(lease))
