"""Lease policies: a minimum hold, a maximum hold and a lock-delay, judged by the database clock.

- ``min_hold`` (ShedLock's ``lockAtLeastFor``): a release before ``acquired + min_hold``
  keeps the grant — same owner, same token — until then, by shortening the row's expiry
  to that moment instead of freeing it. Nobody else is granted the name before it.
- ``max_hold``: every renewal is capped at ``acquired + max_hold`` and refused from then
  on, so the lease ends there, auto-renewed or not.
- ``lock_delay`` (Chubby's and Consul's lock-delay): after a lease ends without a release
  (its holder died or stalled) or is broken, the name cannot be granted again for that
  long.

No new column and no new SQL function: the policies live where the grant path already
looks. The lock-delay is carried in the row's expiry — the row of a grant with
``lock_delay`` ends ``lock_delay`` after the holder's lease does, so every backend's grant
condition (``owner = '' OR expires_us <= now``) already makes the next grant wait — and
the policies are named at the start of the holder text (``[min_hold=5s lock_delay=2s]``),
which is how a break, the admin and the metrics know them. A grant without policies
pays nothing: :func:`resolve` returns None and every other step is skipped.
docs/lease-policies.md has the guarantees and docs/decisions.md the choice.
"""

from __future__ import annotations

from typing import Any

from distlock.backends.policies import DELAY_OWNER, MAX_HOLD_REFUSED, named, seconds_text
from distlock.conf import conf
from distlock.validation import check_seconds

# Re-exported: the holder text's part is the backends' (they read it when breaking).
__all__ = [
    "DEFAULT", "DELAY_OWNER", "MAX_HOLD_REFUSED", "Policies", "named", "resolve",
    "seconds_text",
]

# The value given when a call leaves a policy to its DISTLOCK_* setting.
DEFAULT: Any = object()


class Policies:
    """The policies of one grant, checked (seconds as floats; None: not in force)."""

    __slots__ = ("delay_us", "label", "lock_delay", "max_hold", "min_hold")

    def __init__(
        self, min_hold: float | None, max_hold: float | None, lock_delay: float | None
    ) -> None:
        self.min_hold = min_hold
        self.max_hold = max_hold
        self.lock_delay = lock_delay
        self.delay_us = 0 if lock_delay is None else round(lock_delay * 1e6)
        parts = [
            f"{key}={seconds_text(value)}"
            for key, value in (
                ("min_hold", min_hold), ("max_hold", max_hold), ("lock_delay", lock_delay)
            )
            if value is not None
        ]
        #: What the holder text starts with: ``"[min_hold=5s lock_delay=2s] "``.
        self.label = f"[{' '.join(parts)}] "

    def __repr__(self) -> str:
        return f"<Policies {self.label.strip()}>"

    @property
    def min_hold_us(self) -> int | None:
        return None if self.min_hold is None else round(self.min_hold * 1e6)

    @property
    def max_hold_us(self) -> int | None:
        return None if self.max_hold is None else round(self.max_hold * 1e6)


def _one(value: object, setting: str, what: str) -> float | None:
    if value is DEFAULT:
        value = getattr(conf, setting)
    if value is None:
        return None
    seconds = check_seconds(value, what)
    if seconds <= 0:
        raise ValueError(f"{what} must be positive (None for no {what}), not {seconds}")
    max_ttl = float(conf.MAX_TTL)
    if seconds > max_ttl and what != "max_hold":
        raise ValueError(f"{what} of {seconds} s is longer than DISTLOCK_MAX_TTL ({max_ttl} s)")
    return seconds


def resolve(ttl: float, min_hold: object, max_hold: object, lock_delay: object) -> Policies | None:
    """The policies of a grant of ``ttl`` seconds, from the call's values and the settings
    (``DEFAULT``: the setting; None: none). None when no policy is in force.

    Raises TypeError/ValueError, before any SQL, for a value that is not a positive number
    of seconds (or a timedelta), a ``min_hold`` longer than ``ttl`` (the lease would end
    before the hold it promises) and a ``max_hold`` shorter than ``ttl`` (the first grant
    would already outlast it).
    """
    if (
        min_hold is DEFAULT and max_hold is DEFAULT and lock_delay is DEFAULT
        and conf.MIN_HOLD is None and conf.MAX_HOLD is None and conf.LOCK_DELAY is None
    ):
        return None  # the common case: no policy anywhere, four lookups.
    least = _one(min_hold, "MIN_HOLD", "min_hold")
    most = _one(max_hold, "MAX_HOLD", "max_hold")
    delay = _one(lock_delay, "LOCK_DELAY", "lock_delay")
    if least is None and most is None and delay is None:
        return None
    if least is not None and least > ttl:
        raise ValueError(
            f"min_hold of {least} s is longer than the ttl ({ttl} s): the lease would end "
            "before the hold; give a ttl at least as long"
        )
    if most is not None and most < ttl:
        raise ValueError(
            f"max_hold of {most} s is shorter than the ttl ({ttl} s): the first grant "
            "would already outlast it; give a ttl at most as long"
        )
    return Policies(least, most, delay)
