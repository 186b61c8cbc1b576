"""The part of a task lock decorator that does not depend on the task runner.

:mod:`distlock.celery` and :mod:`distlock.tasks` (Django's Tasks framework) make the same
promises: the lock is named from the call's arguments, the body gets its lease as a
keyword-only ``lease`` hidden from the task's public signature, and the lock is released
however the body ends. Those promises live here once, so the two decorators cannot drift
apart; each keeps only what its runner does differently (finding the running task,
retrying it, what its messages look like).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from distlock.exceptions import LockTimeout
from distlock.integrations.policies import Alias, ContentionPolicy, resolve
from distlock.names import NameTemplate
from distlock.validation import Seconds, check_name, check_timeout, check_ttl

if TYPE_CHECKING:
    from distlock.core.leases import Lease, LostCallback

__all__ = ["TaskFunction", "arun_locked", "check_namer", "check_options", "run_locked"]

R = TypeVar("R")


def check_namer(name: object) -> NameTemplate | None:
    """The parsed template of a lock name given as a str, or None for a callable.

    Raises TypeError if ``name`` is neither, ValueError for a malformed template.
    """
    if isinstance(name, str):
        return NameTemplate(name, example="invoice_id")
    if not callable(name):
        raise TypeError(
            f"lock name must be a str template or a callable, not {type(name).__name__}"
        )
    return None


def check_options(
    name: object, *, ttl: Seconds | None, timeout: Seconds | None,
    on_contention: ContentionPolicy | Alias, countdown: Seconds, max_retries: int | None,
    jitter: bool | Seconds,
) -> tuple[float | None, ContentionPolicy]:
    """``locked_task``'s options, checked at decoration so a bad one fails at import:
    ``(timeout in seconds or None, the contention policy)``.

    The TTL is only checked here, not kept: each run checks it again (the settings may
    have changed) and, with none given, reads DISTLOCK_DEFAULT_TTL then. Raises
    TypeError/ValueError for a bad option.
    """
    check_namer(name)
    if ttl is not None:
        check_ttl(ttl)
    wait = check_timeout(timeout)
    policy = resolve(
        on_contention, timeout=wait, countdown=countdown, max_retries=max_retries,
        jitter=jitter,
    )
    return wait, policy


class TaskFunction:
    """A task function whose runs each hold a lock: its lock name per call, its lease.

    Checked when it is made, so a bad decorator fails at import: every template field
    must be a parameter of ``func``, ``lease`` (if declared) must be keyword-only, and
    none of ``reserved`` (names the decorator passes for itself) may be a parameter.
    Raises ValueError/TypeError otherwise.
    """

    def __init__(
        self, func: Callable[..., Any], name: str | Callable[..., str], *,
        reserved: Iterable[str] = (),
    ) -> None:
        self.func = func
        self.name = name
        self.template = check_namer(name)
        signature = inspect.signature(func)
        params = signature.parameters
        if self.template is not None:
            self.template.check_parameters(params, func.__qualname__)
        for word in reserved:
            if word in params:
                raise TypeError(
                    f"{func.__qualname__}(): the parameter name {word!r} is reserved: "
                    "distlock passes it to its own wrapper"
                )
        self.takes_lease = "lease" in params
        if self.takes_lease and params["lease"].kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(
                f"{func.__qualname__}(): 'lease' must be a keyword-only parameter "
                "(def task(..., *, lease)); distlock passes it, callers never do"
            )
        #: The signature callers see: the function's own, without ``lease``.
        self.public = signature.replace(
            parameters=[p for p in params.values() if p.name != "lease"]
        )

    def lock_name(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, skip: int) -> str:
        """The lock name of a call; a callable name does not get the first ``skip`` args
        (the bound Celery task, the Django Tasks context), a template sees them all."""
        if self.template is not None:
            return check_name(self.template.format_call(self.public, args, kwargs))
        assert callable(self.name)
        return check_name(self.name(*args[skip:], **kwargs))

    @staticmethod
    def refuse_lease(kwargs: dict[str, Any]) -> None:
        """Raise TypeError if a caller passed ``lease`` (only distlock does)."""
        if "lease" in kwargs:
            raise TypeError("the lease is passed by distlock; do not pass 'lease' yourself")

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any], lease: Lease) -> Any:
        """Run the function, handing it ``lease`` if it takes one."""
        if self.takes_lease:
            return self.func(*args, lease=lease, **kwargs)
        return self.func(*args, **kwargs)

    def present(self, wrapper: Callable[..., Any]) -> None:
        """Show ``wrapper`` (made with functools.wraps) with the public signature."""
        wrapper.__signature__ = self.public  # type: ignore[attr-defined]
        # functools.wraps set __wrapped__; tools that follow it would show (and the task
        # runners' argument checks would read) the signature with 'lease' in it.
        del wrapper.__wrapped__  # type: ignore[attr-defined]


def run_locked(
    body: Callable[[Lease], R], name: str, *, ttl: float, timeout: float,
    using: str | None, holder: str, auto_renew: bool, on_lost: LostCallback | None,
    permits: int | None = None,
) -> tuple[bool, R | None]:
    """Run ``body(lease)`` holding lock ``name``: ``(True, its result)``, or ``(False,
    None)`` if the lock was not had within ``timeout`` seconds (the body did not run).
    With ``permits`` (a task's ``limit=``) the lease is a permit of semaphore ``name``.

    The lock is released when the body returns or raises. A LockTimeout raised by the
    body itself (a lock it takes inside) is the body's error, not contention: it is
    raised, not reported as ``(False, None)``.
    """
    # Imported here: a tasks module importing a decorator may load before Django's app
    # registry is ready, and distlock.core.locks imports the Lock model.
    from distlock.core.locks import lock
    from distlock.semaphores import semaphore

    entered = False
    block = (
        lock(name, ttl=ttl, timeout=timeout, using=using, holder=holder,
             auto_renew=auto_renew, on_lost=on_lost) if permits is None
        else semaphore(name, permits=permits, ttl=ttl, timeout=timeout, using=using,
                       holder=holder, auto_renew=auto_renew, on_lost=on_lost)
    )
    try:
        with block as lease:
            entered = True
            return True, body(lease)
    except LockTimeout:
        if entered:
            raise
    return False, None


async def arun_locked(
    body: Callable[[Lease], Awaitable[R]], name: str, *, ttl: float, timeout: float,
    using: str | None, holder: str, auto_renew: bool, on_lost: LostCallback | None,
    permits: int | None = None,
) -> tuple[bool, R | None]:
    """:func:`run_locked` for a coroutine body, under :class:`~distlock.alock` (waiting
    does not block the event loop; auto-renewal is an asyncio task), or
    :class:`~distlock.asemaphore` with ``permits``."""
    from distlock.core.async_locks import alock
    from distlock.semaphores import asemaphore

    entered = False
    block = (
        alock(name, ttl=ttl, timeout=timeout, using=using, holder=holder,
              auto_renew=auto_renew, on_lost=on_lost) if permits is None
        else asemaphore(name, permits=permits, ttl=ttl, timeout=timeout, using=using,
                        holder=holder, auto_renew=auto_renew, on_lost=on_lost)
    )
    try:
        async with block as lease:
            entered = True
            return True, await body(lease)
    except LockTimeout:
        if entered:
            raise
    return False, None
