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
    StaleToken,
    TokenExhausted,
    TransactionNotAllowed,
)

if TYPE_CHECKING:
    from distlock.async_locks import (
        aacquire,
        abreak_lock,
        alock,
        alocked,
        apurge_locks,
    )
    from distlock.failover import raise_tokens
    from distlock.leases import Lease
    from distlock.locks import (
        acquire,
        break_lock,
        current_lease,
        lock,
        locked,
        purge_locks,
    )

__all__ = [
    "DistlockError",
    "Lease",
    "LockLost",
    "LockTimeout",
    "NestedLock",
    "StaleToken",
    "TokenExhausted",
    "TransactionNotAllowed",
    "aacquire",
    "abreak_lock",
    "acquire",
    "alock",
    "alocked",
    "apurge_locks",
    "break_lock",
    "current_lease",
    "lock",
    "locked",
    "purge_locks",
    "raise_tokens",
]

_LAZY = {
    "Lease": "distlock.leases",
    "aacquire": "distlock.async_locks",
    "abreak_lock": "distlock.async_locks",
    "alock": "distlock.async_locks",
    "alocked": "distlock.async_locks",
    "apurge_locks": "distlock.async_locks",
    "acquire": "distlock.locks",
    "break_lock": "distlock.locks",
    "current_lease": "distlock.locks",
    "lock": "distlock.locks",
    "locked": "distlock.locks",
    "purge_locks": "distlock.locks",
    "raise_tokens": "distlock.failover",
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
