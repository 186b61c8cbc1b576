"""The exceptions distlock raises.

Everything distlock raises on purpose is a :class:`DistlockError`, so one ``except`` clause
catches the lot. Bad arguments are the exception: they raise plain :class:`TypeError` or
:class:`ValueError` (as the standard library does), because they are programming errors
that no ``except DistlockError`` around a critical section should swallow.
"""

from __future__ import annotations

__all__ = [
    "DistlockError",
    "LockTimeout",
    "LockLost",
    "StaleToken",
    "TokenExhausted",
    "TransactionNotAllowed",
]


class DistlockError(Exception):
    """Base class of every error distlock raises on purpose."""


class LockTimeout(DistlockError, TimeoutError):
    """The lock could not be acquired before the timeout ran out.

    Also a :class:`TimeoutError`, so code that already handles timeouts handles this one.
    """

    def __init__(self, name: str, timeout: float | None) -> None:
        self.name = name
        self.timeout = timeout
        super().__init__(f"could not acquire lock {name!r} within {timeout} s")

    def __reduce__(self) -> tuple[object, ...]:
        # Picklable with its own arguments: Celery pickles a task's exception.
        return (type(self), (self.name, self.timeout))


class LockLost(DistlockError):
    """The lease is no longer held: it expired, was broken, or another owner has the lock."""

    def __init__(self, name: str, token: int, reason: str) -> None:
        self.name = name
        self.token = token
        self.reason = reason
        super().__init__(f"lock {name!r} (token {token}) is lost: {reason}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.token, self.reason))


class StaleToken(DistlockError):
    """A fenced write was refused because the lease presented is not the current one."""


class TokenExhausted(DistlockError):
    """The lock's fencing token reached the largest value a 64-bit column holds.

    Tokens must never repeat or go backwards, so distlock refuses to grant rather than wrap.
    """


class TransactionNotAllowed(DistlockError, RuntimeError):
    """A lock operation could not commit on its own, or would wait for the caller's own
    transaction.

    Raised inside ``transaction.atomic()`` or with autocommit off on the lock's database: a
    grant must be committed before the critical section starts, and inside the caller's
    transaction it would only commit (or roll back, handing the same token out twice) with
    that transaction, so distlock refuses instead of silently deferring the grant. Also
    raised by renew, break, purge and acquire of a lock whose row the caller's open
    transaction holds through an uncommitted fenced write (see distlock/core/uncommitted.py).
    """
