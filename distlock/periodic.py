"""Periodic jobs across hosts: run a body at most once per period, whichever hosts fire it.

Celery beat on two hosts, or cron on every web node, fires the same job once per host per
period. A plain lock does not make that "once": the job on host A finishes in 50 ms and
releases, and host B, whose clock is 200 ms behind, fires after that and runs it again.
ShedLock's answer is to keep the lock for a minimum time after the run (``lockAtLeastFor``).

:func:`periodic_once` claims the *period* instead. Each call (a fire) reads the database
clock, takes the scheduled instant nearest to it, ``at + k · every``, and tries once a lock
named after that instant (``"reports:hourly@2026-12-04T15:00:00.000Z"``). The first fire
of a period gets it and runs the body; the lease is **not released**: it lives ``ttl``
(at least ``every``), so every later fire that counts for the same instant finds it held
and skips. The tolerance that follows: fires of one period may land anywhere within half
a period of its instant by the database clock (host skew, beat jitter, queue delay); a fire
later than that counts for the next period. The body runs at most once per period, not at
least once: a body that raised still used its period (its exception goes to the caller).

Why a lock per period rather than a minimum hold on one lock: a hold set from the first
fire tolerates a quarter period of spread (it must cover the fires before and after it and
end before the next period's), a lock per period half of one; and nothing waits for a hold
to end. The cost is one lock row per period, idle once its lease ended, removed by
``distlock_purge`` like any idle row (a job every minute leaves 1,440 rows a day).

Inside the body ``current_lease()`` is the period's lease (``is_current()`` says whether it
still holds). Each period has its own lock, so runs of two periods do not exclude each
other: a run that outlasts its period may overlap the next one's. A body that must never
overlap itself takes a lock of its own inside (``with lock("reports:hourly"): ...``), whose
token then also fences its writes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import ParamSpec, TypeVar

from distlock.constants import MAX_NAME_LENGTH
from distlock.core.blocks import refuse_async
from distlock.core.locks import acquire, as_current
from distlock.db import db_now_us
from distlock.validation import (
    Seconds,
    check_name,
    check_seconds,
    check_text,
    check_ttl,
    check_using,
)

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger("distlock")

#: The shortest period: the database clocks' resolution (SQLite: 1 ms) and a fire's own
#: round trips must be small beside half of it.
MIN_EVERY = 1.0


def periodic_once(
    name: str,
    *,
    every: Seconds,
    at: Seconds = 0,
    ttl: Seconds | None = None,
    using: str | None = None,
    holder: str = "",
) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
    """Decorate a job so that its body runs at most once per period across every process.

    ``every`` is the period (seconds or a timedelta, at least one second) and ``at`` its
    phase: the scheduled instants are ``at + k · every`` seconds after the Unix epoch, UTC
    (``at=0``: whole minutes for ``every=60``, midnights UTC for a day; a job at 02:00 in
    Asia/Kolkata, 20:30 UTC, passes ``every=timedelta(days=1), at=timedelta(hours=20,
    minutes=30)``). Each call counts for the instant nearest to the database clock and runs
    the body if no call counted for it before, returning its result; otherwise it returns
    None without running it. ``ttl`` is the lease of the run (default ``every``, never less:
    the period's lock must outlast every fire of its period); make it longer than the
    longest run if the body fences its writes with ``current_lease()``.

    Put it under Celery's task decorator (``@app.task`` over ``@periodic_once(...)``): a
    beat on every host then enqueues one task per host per period, and one of them runs
    the body. Bad arguments raise at decoration; an ``async def`` function is refused
    (TypeError), as ``@locked`` refuses it.
    """
    every_s = check_seconds(every, "every")
    if every_s < MIN_EVERY:
        raise ValueError(f"every must be at least {MIN_EVERY:g} s, not {every_s:g}")
    at_s = check_seconds(at, "at")
    ttl_s = check_ttl(every_s if ttl is None else ttl)
    if ttl_s < every_s:
        raise ValueError(
            f"ttl ({ttl_s:g} s) must be at least every ({every_s:g} s): the period's lock "
            "must outlast every fire that counts for its instant"
        )
    check_name(name)
    if len(name) + _SUFFIX_LENGTH > MAX_NAME_LENGTH:
        raise ValueError(
            f"name is too long for a periodic job: at most {MAX_NAME_LENGTH - _SUFFIX_LENGTH} "
            f"characters (the lock of each period adds {_SUFFIX_LENGTH}), not {len(name)}"
        )
    check_text(holder, "holder")
    if using is not None:
        check_using(using)
    every_us = round(every_s * 1e6)
    at_us = round(at_s * 1e6) % every_us

    def decorate(func: Callable[P, R]) -> Callable[P, R | None]:
        refuse_async(func, "@periodic_once(...)")

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
            alias = check_using(using)
            instant_us = nearest_instant(db_now_us(alias), every_us, at_us)
            lease = acquire(
                _instant_name(name, instant_us), ttl=ttl_s, timeout=0, using=alias,
                holder=holder,
                min_hold=None, max_hold=None, lock_delay=None,  # not the settings'
            )
            if lease is None:
                logger.debug("periodic job %r: the period of %s has run", name, instant_us)
                return None
            with as_current(lease):
                return func(*args, **kwargs)

        return wrapper

    return decorate


def nearest_instant(now_us: int, every_us: int, at_us: int) -> int:
    """The scheduled instant ``at + k · every`` nearest to ``now`` (epoch microseconds);
    halfway between two, the later one."""
    return at_us + (now_us - at_us + every_us // 2) // every_us * every_us


def _instant_name(name: str, instant_us: int) -> str:
    """The lock of one period: ``name@2026-12-04T15:00:00.000Z`` (UTC, milliseconds)."""
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=instant_us)
    return f"{name}@{moment:%Y-%m-%dT%H:%M:%S}.{moment.microsecond // 1000:03d}Z"


#: "@" and the instant, as ``_instant_name`` writes it ("@2026-12-04T15:00:00.000Z").
_SUFFIX_LENGTH = len(_instant_name("", 0))
