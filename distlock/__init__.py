"""distlock: distributed locks stored as database rows, with fencing tokens.

The public names are imported lazily, so ``import distlock`` (e.g. from settings) does not
import models before Django's app registry is ready.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from distlock.exceptions import (
    DistlockError,
    LockLost,
    LockTimeout,
    NestedLock,
    NotReplicated,
    StaleToken,
    TokenExhausted,
    TransactionNotAllowed,
)

if TYPE_CHECKING:
    from distlock.core.async_groups import aacquire_all, alock_all
    from distlock.core.async_locks import (
        aacquire,
        abreak_lock,
        alock,
        alocked,
        apurge_locks,
    )
    from distlock.core.groups import LeaseGroup, acquire_all, lock_all
    from distlock.core.inspection import LockStatus, alock_status, lock_status
    from distlock.core.leases import Lease
    from distlock.core.locks import (
        acquire,
        break_lock,
        current_lease,
        lock,
        locked,
    )
    from distlock.core.purge import purge_locks
    from distlock.ops.failover import raise_tokens
    from distlock.rwlocks import (
        aacquire_read,
        aacquire_write,
        acquire_read,
        acquire_write,
        aread_lock,
        awrite_lock,
        read_lock,
        write_lock,
    )
    from distlock.semaphores import (
        Permit,
        SemaphoreStatus,
        aacquire_permit,
        acquire_permit,
        asemaphore,
        asemaphore_status,
        semaphore,
        semaphore_status,
    )

__all__ = [
    "DistlockError",
    "Lease",
    "LeaseGroup",
    "LockLost",
    "LockStatus",
    "LockTimeout",
    "NestedLock",
    "Permit",
    "SemaphoreStatus",
    "NotReplicated",
    "StaleToken",
    "TokenExhausted",
    "TransactionNotAllowed",
    "aacquire",
    "aacquire_all",
    "aacquire_permit",
    "aacquire_read",
    "aacquire_write",
    "abreak_lock",
    "acquire",
    "acquire_all",
    "acquire_permit",
    "acquire_read",
    "acquire_write",
    "alock",
    "alock_all",
    "alock_status",
    "alocked",
    "apurge_locks",
    "aread_lock",
    "asemaphore",
    "asemaphore_status",
    "awrite_lock",
    "break_lock",
    "current_lease",
    "lock",
    "lock_all",
    "lock_status",
    "locked",
    "purge_locks",
    "raise_tokens",
    "read_lock",
    "semaphore",
    "semaphore_status",
    "write_lock",
]

_LAZY = {
    "Lease": "distlock.core.leases",
    "LeaseGroup": "distlock.core.groups",
    "acquire_all": "distlock.core.groups",
    "lock_all": "distlock.core.groups",
    "aacquire_all": "distlock.core.async_groups",
    "alock_all": "distlock.core.async_groups",
    "LockStatus": "distlock.core.inspection",
    "alock_status": "distlock.core.inspection",
    "lock_status": "distlock.core.inspection",
    "aacquire": "distlock.core.async_locks",
    "abreak_lock": "distlock.core.async_locks",
    "alock": "distlock.core.async_locks",
    "alocked": "distlock.core.async_locks",
    "apurge_locks": "distlock.core.async_locks",
    "acquire": "distlock.core.locks",
    "break_lock": "distlock.core.locks",
    "current_lease": "distlock.core.locks",
    "lock": "distlock.core.locks",
    "locked": "distlock.core.locks",
    "purge_locks": "distlock.core.purge",
    "raise_tokens": "distlock.ops.failover",
    "Permit": "distlock.semaphores",
    "SemaphoreStatus": "distlock.semaphores",
    "aacquire_permit": "distlock.semaphores",
    "acquire_permit": "distlock.semaphores",
    "asemaphore": "distlock.semaphores",
    "asemaphore_status": "distlock.semaphores",
    "semaphore": "distlock.semaphores",
    "semaphore_status": "distlock.semaphores",
    "aacquire_read": "distlock.rwlocks",
    "aacquire_write": "distlock.rwlocks",
    "acquire_read": "distlock.rwlocks",
    "acquire_write": "distlock.rwlocks",
    "aread_lock": "distlock.rwlocks",
    "awrite_lock": "distlock.rwlocks",
    "read_lock": "distlock.rwlocks",
    "write_lock": "distlock.rwlocks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        # Kept as a module global: the next ``distlock.acquire`` (or ``from distlock
        # import acquire`` in a function) is a plain lookup, not an import each call.
        globals()[name] = value
        return value
    raise AttributeError(f"module 'distlock' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
