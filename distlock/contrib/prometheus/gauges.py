"""Database-wide gauges, read from the lock database when Prometheus scrapes: locks held
now, locks expired and not taken over, sessions waiting.

The other metrics (:mod:`.metrics`) are what this process did; these are what the lock
table says, the same number from every process that serves them (aggregate them with
``max``, not ``sum``). A custom collector (prometheus_client's ``Collector``) runs the
queries at scrape time, so nothing polls the database between scrapes:

- held and expired are one ``COUNT`` over the owned rows (``owner > ''``:
  :func:`distlock.core.status.state_is`, the condition of migration 0001's partial index
  on PostgreSQL and SQLite, its index on ``owner`` on MariaDB), so a million idle rows
  are not read (benchmarks/gauges.py);
- waiting is what the backend's wake-up registrations show (PostgreSQL: ``pg_locks``);
  where waiters register nowhere (MariaDB, SQLite: they poll) the gauge is *absent*,
  not 0, because 0 would say that nobody waits.

A scrape whose queries fail (the database down, a missing table) still succeeds: the
gauges are left out of it, the failure is logged on ``distlock.metrics`` (WARNING) and
counted in ``distlock_gauge_failures_total``, which is in every scrape, so an alert can
tell "no locks held" from "could not look".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from django.db import connections
from django.db.models import Count, Q
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from distlock.backends import backend_for
from distlock.conf import conf
from distlock.constants import LEADER_MARK
from distlock.core.status import EXPIRED, HELD, state_is
from distlock.db import db_now_us

logger = logging.getLogger("distlock.metrics")

# The most locks backend.waiting() reports (the most waited-for first): sessions waiting
# for locks past them are not counted. A site with more distinct locks waited for at one
# moment has bigger problems than this gauge.
WAITING_LIMIT = 1000

HELD_NOW = ("distlock_locks_held", "Locks held now in the lock database (owned, lease not "
            "run out by the database clock).")
EXPIRED_NOW = ("distlock_locks_expired", "Locks whose lease ran out and that nobody has "
               "taken over: the holder did not renew or release (probably gone).")
WAITING_NOW = ("distlock_sessions_waiting", "Sessions waiting for a lock now, as the "
               "wake-up registrations show them (PostgreSQL); a session counts once per "
               "lock it waits for.")
LEADER_TERM = ("distlock_leader_term", "The term (fencing token) of each election's leader "
               "now (distlock.leader), by the election's name pattern; an election with "
               "no leader now has no sample.", ["election"])
# The most elections' locks one scrape reads.
LEADERS_LIMIT = 1000
TASK_KEYS = ("distlock_task_keys", "Keys of enqueue_once() with a live slot now, by slot: "
             "a task sent and not started (queued), a run in its body (running).")
WITH_POLICY = ("distlock_locks_held_with_policy", "Locks held now whose grant has this "
               "lease policy (min_hold, max_hold, lock_delay; a row in a lock-delay after a "
               "break counts as lock_delay).", ["policy"])
POLICIES = ("min_hold", "max_hold", "lock_delay")
FAILURES = ("distlock_gauge_failures", "Scrapes whose database gauges could not be read "
            "(the gauges were left out of them).")


def read(alias: str) -> tuple[int, int, int | None]:
    """(held, expired, waiting) in database ``alias`` now; waiting None where unknown.

    Raises what the database raises.
    """
    from distlock.models import Lock

    now = db_now_us(alias)
    counts = Lock.objects.using(alias).filter(owner__gt="").aggregate(
        held=Count("pk", filter=state_is(HELD, now)),
        expired=Count("pk", filter=state_is(EXPIRED, now)),
    )
    connection = connections[alias]
    with connection.cursor() as cursor:
        found = backend_for(connection).waiting(cursor, WAITING_LIMIT)
    waiting = None if found is None else sum(sessions for _, sessions, _ in found)
    return int(counts["held"]), int(counts["expired"]), waiting


def read_leaders(alias: str) -> dict[str, int]:
    """The term of each election's leader held now in ``alias``, by the name pattern of the
    ``lock`` label (the highest term where a pattern covers several elections). Read
    through the owned rows' index, as :func:`read`'s count."""
    from distlock.contrib.prometheus.labels import pattern_of
    from distlock.models import Lock

    now = db_now_us(alias)
    rows = Lock.objects.using(alias).filter(owner__gt="").filter(
        state_is(HELD, now), holder__contains=LEADER_MARK
    ).values_list("name", "token")[:LEADERS_LIMIT]
    terms: dict[str, int] = {}
    for name, token in rows:
        election = pattern_of(name)
        terms[election] = max(token, terms.get(election, 0))
    return terms


def read_task_keys() -> tuple[int, int]:
    """(queued, running): the keys of enqueue_once() whose slot has not ended by the
    database clock, in the database TaskKey is read from. Raises what the database raises."""
    from django.db import router

    from distlock.models import TaskKey

    alias = router.db_for_read(TaskKey)
    now = db_now_us(alias)
    counts = TaskKey.objects.using(alias).aggregate(
        queued=Count("pk", filter=Q(queued_until_us__gt=now)),
        running=Count("pk", filter=Q(running_until_us__gt=now)),
    )
    return int(counts["queued"]), int(counts["running"])


def read_policies(alias: str) -> dict[str, int]:
    """Locks held now in database ``alias`` per lease policy, as their holder texts name
    them (``[min_hold=5s lock_delay=2s] …``: distlock/core/policies.py). One COUNT over the
    owned rows, as :func:`read`'s; the regular expression runs only on held rows whose
    holder starts with ``[``."""
    from distlock.models import Lock

    now = db_now_us(alias)
    held = Lock.objects.using(alias).filter(owner__gt="").filter(
        state_is(HELD, now), holder__startswith="["
    )
    counts = held.aggregate(**{
        policy: Count("pk", filter=Q(holder__regex=rf"^\[[^]]*{policy}="))
        for policy in POLICIES
    })
    return {policy: int(counts[policy]) for policy in POLICIES}


class DatabaseGauges(Collector):
    """The collector of the database-wide gauges (lock database ``using``, default
    distlock's, read at each scrape)."""

    def __init__(self, using: str | None = None) -> None:
        self.using = using
        self._failures = 0
        self._mutex = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        """The families without samples: registering the collector reads no database
        (it happens in ready(), before any request)."""
        return [GaugeMetricFamily(*HELD_NOW), GaugeMetricFamily(*EXPIRED_NOW),
                GaugeMetricFamily(*WAITING_NOW), _policy_family(), _labelled(LEADER_TERM),
                GaugeMetricFamily(*TASK_KEYS, labels=["slot"]),
                CounterMetricFamily(*FAILURES)]

    def collect(self) -> Iterable[Metric]:
        alias = self.using or conf.database()
        try:
            held, expired, waiting = read(alias)
            with_policy = read_policies(alias)
            leaders = read_leaders(alias)
        except Exception:
            # Whatever went wrong, the scrape of every other metric must still answer.
            logger.warning("distlock gauges: could not read database %r", alias,
                           exc_info=True)
            with self._mutex:
                self._failures += 1
            _close_if_broken(alias)
        else:
            yield GaugeMetricFamily(*HELD_NOW, value=held)
            yield GaugeMetricFamily(*EXPIRED_NOW, value=expired)
            if waiting is not None:
                yield GaugeMetricFamily(*WAITING_NOW, value=waiting)
            family = _policy_family()
            for policy, count in with_policy.items():
                family.add_metric([policy], count)
            yield family
            terms = _labelled(LEADER_TERM)
            for election, term in sorted(leaders.items()):
                terms.add_metric([election], term)
            yield terms
        yield from self._task_keys()
        yield CounterMetricFamily(*FAILURES, value=self._failures)

    def _task_keys(self) -> Iterable[Metric]:
        """The task keys' gauge, left out (and counted as a failure) on its own when its
        database cannot be read: it may not be the lock database."""
        try:
            queued, running = read_task_keys()
        except Exception:
            logger.warning("distlock gauges: could not read the task keys", exc_info=True)
            with self._mutex:
                self._failures += 1
            return
        family = GaugeMetricFamily(*TASK_KEYS, labels=["slot"])
        family.add_metric(["queued"], queued)
        family.add_metric(["running"], running)
        yield family


def _policy_family() -> GaugeMetricFamily:
    return _labelled(WITH_POLICY)


def _labelled(spec: tuple[str, str, list[str]]) -> GaugeMetricFamily:
    name, documentation, labels = spec
    return GaugeMetricFamily(name, documentation, labels=labels)


def _close_if_broken(alias: str) -> None:
    """Drop a connection the failure left unusable, so the next scrape connects again (an
    exporter thread of prometheus_client's keeps its connection between scrapes)."""
    try:
        connection = connections[alias]
        if not connection.in_atomic_block:
            connection.close_if_unusable_or_obsolete()
    except Exception:
        logger.debug("distlock gauges: closing %r failed", alias, exc_info=True)


# The collector registered in each registry (one each: a second would repeat the names).
_registered: dict[CollectorRegistry, DatabaseGauges] = {}
_lock = threading.Lock()


def register(registry: CollectorRegistry = REGISTRY) -> DatabaseGauges:
    """Register the collector in ``registry`` (idempotent); the app's ready() does."""
    with _lock:
        found = _registered.get(registry)
        if found is None:
            found = _registered[registry] = DatabaseGauges()
            registry.register(found)
        return found


def unregister(registry: CollectorRegistry = REGISTRY) -> None:
    """Take it out of ``registry`` again (idempotent)."""
    with _lock:
        found = _registered.pop(registry, None)
        if found is not None:
            registry.unregister(found)
