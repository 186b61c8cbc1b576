"""Helpers for users' own tests of code that locks and writes fenced rows.

They go through the lock table the way distlock does, so the code under test meets the
same rows and tokens it would meet in production: a lock busy under another owner, or a
lease that has gone stale while its holder still believes in it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from distlock import db
from distlock.core.leases import Lease
from distlock.core.locks import acquire
from distlock.validation import Seconds

__all__ = ["hold_lock", "make_stale", "take_over"]


@contextmanager
def hold_lock(
    name: str, *, ttl: Seconds | None = None, using: str | None = None,
    holder: str = "distlock.testing",
) -> Iterator[Lease]:
    """Hold lock ``name`` as another owner for the ``with`` block; yield that lease.

    The code under test then finds the lock busy, as if another worker had it. Raises
    RuntimeError if the lock is already held. Released when the block ends.
    """
    lease = acquire(name, ttl=ttl, blocking=False, using=using, holder=holder)
    if lease is None:
        raise RuntimeError(f"hold_lock: lock {name!r} is already held by someone else")
    try:
        yield lease
    finally:
        lease.release()


def make_stale(lease: Lease) -> None:
    """End ``lease`` in the database now, as if its holder had paused past its ttl.

    The lease object is left alone: like a paused process, it still believes it holds
    the lock (``remaining()`` keeps counting down its local clock), but its fenced writes
    are refused by the ownership check and anyone may acquire the lock. Raises
    ValueError if the lease is not the lock's current grant.
    """
    if db.run(lease.using, "expire", lease.name, lease.owner, lease.token) != 1:
        raise ValueError(f"{lease!r} is not the current grant of lock {lease.name!r}")


def take_over(lease: Lease, *, ttl: Seconds | None = None, holder: str = "distlock.testing",
              ) -> Lease:
    """Make ``lease`` stale and acquire its lock as a new owner; return the new lease.

    The new lease has the next token, so rows it writes refuse the old lease on the
    high-water mark too. Release it when done (or let its ttl run out).
    """
    make_stale(lease)
    new = acquire(lease.name, ttl=ttl, blocking=False, using=lease.using, holder=holder)
    if new is None:
        raise RuntimeError(f"take_over: lock {lease.name!r} was taken by someone else first")
    return new
