"""The metrics and the signal receivers that keep them (connected by the app's ready()).

Every metric has one label, ``lock``: the pattern of the lock name (:mod:`.labels`). The
numbers are this process's (prometheus_client's default registry): Prometheus adds them
up across the processes it scrapes. A server with several worker processes behind one
port needs prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``).

Receivers never raise: the signals are sent after the lock change committed, inside the
caller's acquire, release or write, and an exception there would reach a caller whose
lock operation succeeded.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from django.dispatch import Signal
from prometheus_client import Counter, Gauge, Histogram

from distlock import signals
from distlock.contrib.prometheus.labels import pattern_of

if TYPE_CHECKING:
    from distlock.core.leases import Lease

LABELS = ("lock",)
# Seconds: a grant is mostly immediate or waits for a release or an expiry (ttls of
# seconds to minutes); a hold is a critical section (ms) up to a long job (an hour).
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600)

GRANTS = Counter(
    "distlock_grants", "Leases granted to this process.", LABELS,
)
BUSY = Counter(
    "distlock_busy_tries",
    "Acquires that were not to wait (blocking=False or timeout=0) and found the lock held.",
    LABELS,
)
TIMEOUTS = Counter(
    "distlock_timeouts", "Blocking acquires that gave up when their timeout ran out.", LABELS,
)
RELEASES = Counter(
    "distlock_releases", "Releases that freed a lock this process still held.", LABELS,
)
BREAKS = Counter(
    "distlock_breaks", "Held locks broken by this process (break_lock, admin, command).",
    LABELS,
)
LOST = Counter(
    "distlock_leases_lost",
    "Leases this process learned it had lost: a failed renewal, a refused fenced write, "
    "a release after the lease had run out or been broken.",
    LABELS,
)
STALE_WRITES = Counter(
    "distlock_stale_writes_refused", "Fenced writes refused because their lease was stale.",
    LABELS,
)
WAIT = Histogram(
    "distlock_wait_seconds", "Time from an acquire call to the try that got the lock.",
    LABELS, buckets=WAIT_BUCKETS,
)
HOLD = Histogram(
    "distlock_hold_seconds",
    "Time from a grant to its release (or to learning it was lost), by this process's clock.",
    LABELS, buckets=HOLD_BUCKETS,
)
HELD = Gauge(
    "distlock_leases_held", "Leases this process holds now (granted, not released or lost).",
    LABELS,
)

class Series:
    """The time series of one ``lock`` label, looked up once.

    ``Metric.labels()`` takes a lock and checks its values on every call; a grant and a
    release would call it five times. Made together, so every metric of a label exists
    from its first event on, at zero where nothing happened: ``increase()`` and
    ``rate()`` then see a counter's first step (a series born at 1 shows no increase).
    """

    __slots__ = ("breaks", "busy", "grants", "held", "hold", "lost", "releases",
                 "stale_writes", "timeouts", "wait")

    def __init__(self, label: str) -> None:
        self.grants = GRANTS.labels(label)
        self.busy = BUSY.labels(label)
        self.timeouts = TIMEOUTS.labels(label)
        self.releases = RELEASES.labels(label)
        self.breaks = BREAKS.labels(label)
        self.lost = LOST.labels(label)
        self.stale_writes = STALE_WRITES.labels(label)
        self.wait = WAIT.labels(label)
        self.hold = HOLD.labels(label)
        self.held = HELD.labels(label)


_series: dict[str, Series] = {}


def series(name: str) -> Series:
    """The series of lock ``name``'s pattern."""
    label = pattern_of(name)
    found = _series.get(label)
    if found is None:
        # setdefault: two threads meeting here keep one (the children are the same ones).
        found = _series.setdefault(label, Series(label))
    return found


_mutex = threading.Lock()
# Each held lease: its series and its monotonic grant time. Weak, so a lease dropped
# without a release is forgotten (its gauge stays up: it was never released).
_held: weakref.WeakKeyDictionary[Lease, tuple[Series, float]] = weakref.WeakKeyDictionary()
# Leases already counted as lost: a lock() block whose lease ran out reports it twice
# (lock_released with held=False, then lock_lost).
_lost: weakref.WeakSet[Lease] = weakref.WeakSet()


def _acquired(sender: object, lease: Lease, waited: float | None = None, **kwargs: Any) -> None:
    found = series(lease.name)
    found.grants.inc()
    if waited is not None:
        found.wait.observe(max(waited, 0.0))
    with _mutex:
        _held[lease] = (found, time.monotonic())
    found.held.inc()


def _not_acquired(sender: object, name: str, timed_out: bool = False, **kwargs: Any) -> None:
    found = series(name)
    (found.timeouts if timed_out else found.busy).inc()


def _ended(lease: Lease, lost: bool) -> Series:
    """The lease is no longer held by this process: hold time, gauge, and loss (once)."""
    with _mutex:
        entry = _held.pop(lease, None)
        count_loss = lost and lease not in _lost
        if count_loss:
            _lost.add(lease)
    if entry is None:
        found = series(lease.name)
    else:
        found, granted = entry
        found.hold.observe(time.monotonic() - granted)
        found.held.dec()
    if count_loss:
        found.lost.inc()
    return found


def _released(sender: object, lease: Lease, held: bool = True, **kwargs: Any) -> None:
    found = _ended(lease, lost=not held)
    if held:
        found.releases.inc()


def _lost_lease(sender: object, lease: Lease, **kwargs: Any) -> None:
    _ended(lease, lost=True)


def _broken(sender: object, name: str, **kwargs: Any) -> None:
    series(name).breaks.inc()


def _stale_write(sender: object, lease: Lease, **kwargs: Any) -> None:
    series(lease.name).stale_writes.inc()


# Shaped like ops/audit.py's table, but each lists the signals its module listens to;
# connecting them is shared (signals.connect_receivers).
def _receivers() -> list[tuple[Signal, Any, str]]:
    return [
        (signals.lock_acquired, _acquired, "acquired"),
        (signals.lock_not_acquired, _not_acquired, "not_acquired"),
        (signals.lock_released, _released, "released"),
        (signals.lock_lost, _lost_lease, "lost"),
        (signals.lock_broken, _broken, "broken"),
        (signals.stale_write_refused, _stale_write, "stale_write"),
    ]


_UID = "distlock.contrib.prometheus."


def connect() -> None:
    """Connect the receivers to distlock's signals (idempotent)."""
    signals.connect_receivers(_receivers(), _UID)


def disconnect() -> None:
    """Disconnect them again (idempotent); the numbers so far stay."""
    signals.disconnect_receivers(_receivers(), _UID)
