"""What the lock operations of :mod:`distlock.backends.base` answer: a Grant or Busy, the
reasons a renewal is refused, the error for a lock out of tokens, and the levels of
distlock_doctor's findings. Plain values, shared by every vendor's module and by the
callers of :func:`distlock.db.run`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlock.constants import MAX_TOKEN
from distlock.exceptions import TokenExhausted

# The levels of distlock_doctor's findings.
OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Grant:
    """A committed grant or renewal, as the database recorded it."""

    token: int
    acquired_us: int
    expires_us: int
    # The holder whose expired lease this grant took over ("" if the lock was free).
    took_over: str = ""


@dataclass(frozen=True)
class Busy:
    """Someone else holds the lock; ``remaining_us`` is their lease left by the DB clock.

    ``remaining_us`` is None when that is unknown: the wait for the lock row was cut
    short by the session's own timeout (see :meth:`Backend.lock_wait_cut_short`).
    """

    token: int
    holder: str
    remaining_us: int | None

    @property
    def handed_over(self) -> bool:
        """PostgreSQL: nobody holds the lock, but a release reserved it for a waiter
        queued with wake-ups on (the hand-off window; a grant always names its holder)."""
        return not self.holder and self.remaining_us is not None


RENEW_REFUSED = {
    "missing": "the lock row no longer exists",
    "changed": "it was released, broken or taken over",
    "expired": "the lease expired before the renewal reached the database",
}


def exhausted(name: str | None = None) -> TokenExhausted:
    """The error for a lock (or, with no name, the whole table) out of fencing tokens."""
    if name is None:
        return TokenExhausted(f"the lock table has used every fencing token up to {MAX_TOKEN}")
    return TokenExhausted(f"lock {name!r} has used every fencing token up to {MAX_TOKEN}")
