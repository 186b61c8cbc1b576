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
    "NestedLock",
    "NotReplicated",
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


class NestedLock(DistlockError, RuntimeError):
    """Lock ``name`` was asked for where it is already held: inside a ``lock()``/``alock()``
    block (or ``@locked``/``locked_task`` run) of the same name in this thread, or in this
    asyncio task.

    Raised at once, before any SQL. Without it the inner acquire would wait for the outer
    lease, its own, until that expired, and then take the lock over from it (a new token;
    the outer block ends "no longer held"). Use the outer lease instead
    (``current_lease()``, or pass it down). ``token`` and ``owner`` name that lease.
    """

    def __init__(self, name: str, token: int, owner: str) -> None:
        self.name = name
        self.token = token
        self.owner = owner
        super().__init__(
            f"lock {name!r} is already held here by the enclosing lock block (token "
            f"{token}, owner {owner}): a nested acquire of the same name by the same "
            "thread or asyncio task would wait for its own lease to expire and then take "
            "it over. Use the outer lease (current_lease()) instead of locking again"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.token, self.owner))


class NotReplicated(DistlockError):
    """A grant, renewal or fenced write committed on the PostgreSQL primary, but its wait
    for the synchronous standby was cancelled (``pg_cancel_backend``, a
    ``statement_timeout``, ``pg_terminate_backend``): the server reported success with a
    WARNING, and a failover to that standby may lose the commit.

    So it is not reported as done. A grant: the lease is not returned (not held), and the
    lock row may name its owner until the ttl ends (possibly held: nobody else gets it
    before then unless a failover loses it). A renewal: the lease is no longer to be
    trusted past its previous expiry. A fenced write: it may or may not survive a
    failover. ``operation`` names the operation, ``warning`` is the server's message.
    Releases do not wait for the standby (``DISTLOCK_DURABLE_RELEASE = False``) and never
    raise it.
    """

    def __init__(self, operation: str, warning: str) -> None:
        self.operation = operation
        self.warning = warning
        super().__init__(
            f"{operation}: committed on the primary, but its wait for the synchronous "
            f"standby was cancelled ({warning}), so a failover may lose it; it is not "
            "reported as done (see distlock.NotReplicated)"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.operation, self.warning))
