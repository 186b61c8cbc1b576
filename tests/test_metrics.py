"""distlock.contrib.prometheus: the metrics of real lock operations, scraped over HTTP.

The main test does what an operator's Prometheus sees: a second real process holds a lock
(so this process's tries find it busy and time out), this process waits for a grant,
breaks a lock, has a stale fenced write refused, and holds a lease — then the demo
project's ``/metrics`` view is fetched from a real HTTP server (pytest-django's live
server) and parsed with prometheus_client's own text parser. Counters are compared as
differences between two scrapes: the registry belongs to the process and keeps its
numbers from test to test.
"""

from __future__ import annotations

import random
import string
import threading
import time
import urllib.request
from typing import Any

import pytest
from django.test import modify_settings, override_settings
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from distlock import (
    StaleToken,
    aacquire,
    acquire,
    break_lock,
    lock,
    signals,
)
from distlock.contrib.prometheus import checks, metrics
from distlock.contrib.prometheus.labels import INVALID, name_pattern
from distlock.exceptions import LockTimeout
from tests.factories import CounterFactory
from tests.support.helpers import expired_lock, run_async

Sample = tuple[str, str, str | None]  # sample name, lock label, le (histogram buckets)


@pytest.fixture
def metrics_on():
    """The receivers connected, as installing the app does, and disconnected afterwards."""
    metrics.connect()
    try:
        yield
    finally:
        metrics.disconnect()


def kind() -> str:
    """A lock kind of this test's own (letters only: the default pattern keeps them)."""
    return "m" + "".join(random.choices(string.ascii_lowercase, k=10))


def value(name: str, label: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"lock": label, **labels}) or 0.0


def not_a_str(name: str) -> object:
    return len(name)


def raises(name: str) -> str:
    raise RuntimeError("pattern function broke")


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("invoice:42", "invoice:*"),
        ("report:7:2025", "report:*"),
        ("account:", "account:*"),
        ("shard12:x", "shard*:*"),
        ("rebuild-2025-01", "rebuild-*-*"),
        ("nightly-report", "nightly-report"),
        (":leading", ":*"),
        ("x" * 200 + ":1", "x" * 100),
    ],
)
def test_the_default_pattern_keeps_the_kind_and_hides_the_key(name, pattern):
    assert name_pattern(name) == pattern


def scrape(base_url: str) -> dict[Sample, float]:
    """GET /metrics and parse it as Prometheus does; the samples that carry a lock label."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=20) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        text = response.read().decode()
    found: dict[Sample, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "lock" in sample.labels:
                key = (sample.name, sample.labels["lock"], sample.labels.get("le"))
                found[key] = sample.value
    return found


def growth(before: dict[Sample, float], after: dict[Sample, float], label: str) -> dict:
    """What each series of ``label`` gained between two scrapes (buckets left out)."""
    return {
        name: after[(name, lock_label, le)] - before.get((name, lock_label, le), 0.0)
        for name, lock_label, le in after
        if lock_label == label and le is None and not name.endswith("_created")
    }


@pytest.mark.processes
def test_the_demo_metrics_endpoint_counts_real_lock_operations(
    children, live_server, settings, metrics_on
):
    settings.ROOT_URLCONF = "demo_project.urls"
    mine = kind()
    label = f"{mine}:*"
    before = scrape(live_server.url)

    # A second real process holds mine:busy: one try that was not to wait, one timeout.
    holder = children.start("hold", f"{mine}:busy", 30)
    holder.expect("acquired")
    assert acquire(f"{mine}:busy", blocking=False) is None
    with pytest.raises(LockTimeout), lock(f"{mine}:busy", timeout=0.2):
        pass
    # A wait for a grant: the holder releases half a second after this acquire began.
    releaser = threading.Timer(0.5, holder.send, ("release",))
    releaser.start()
    waited = acquire(f"{mine}:busy", timeout=20)
    releaser.join()
    assert waited is not None
    assert holder.expect("released")["held"] is True
    holder.send("exit")
    assert holder.finish() == 0
    assert waited.release() is True

    # A break: the broken holder's release finds its lease gone (a lost lease).
    broken = acquire(f"{mine}:7", ttl=30)
    assert break_lock(f"{mine}:7", by="test_metrics")
    assert broken.release() is False

    # A stale write refused: a lease that ran out, a newer grant, the old lease's write.
    counter = CounterFactory(key=mine)
    stale = expired_lock(f"counter:{mine}")
    newer = acquire(f"counter:{mine}", ttl=30)
    with pytest.raises(StaleToken):
        counter.save(fence=stale)
    assert stale.release() is False  # counted lost once, not again here
    assert newer.release() is True

    held = acquire(f"{mine}:held", ttl=30)
    after = scrape(live_server.url)
    held.release()

    gained = growth(before, after, label)
    wait_sum = gained.pop("distlock_wait_seconds_sum")
    hold_sum = gained.pop("distlock_hold_seconds_sum")
    assert gained == {
        "distlock_grants_total": 3.0,  # waited, broken, held
        "distlock_busy_tries_total": 1.0,
        "distlock_timeouts_total": 1.0,
        "distlock_releases_total": 1.0,  # waited (broken's release freed nothing)
        "distlock_breaks_total": 1.0,
        "distlock_leases_lost_total": 1.0,  # broken
        "distlock_wait_seconds_count": 3.0,
        "distlock_hold_seconds_count": 2.0,  # waited and broken ended; held still held
        "distlock_leases_held": 1.0,
        # Every metric of a pattern exists from its first event on, at zero if need be.
        "distlock_stale_writes_refused_total": 0.0,
    }
    # Two grants came at the first try; the third waited for the other process's release.
    assert after[("distlock_wait_seconds_bucket", label, "0.005")] == 2.0
    assert after[("distlock_wait_seconds_bucket", label, "+Inf")] == 3.0
    assert 0.25 <= wait_sum < 20 and 0 < hold_sum < 60

    stale_label = growth(before, after, "counter:*")
    assert stale_label["distlock_stale_writes_refused_total"] == 1.0
    assert stale_label["distlock_leases_lost_total"] == 1.0
    assert stale_label["distlock_grants_total"] == 2.0
    assert stale_label["distlock_releases_total"] == 1.0
    assert stale_label["distlock_leases_held"] == 0.0
    # The key of a lock name never becomes a label value.
    assert not [key for key in after if mine in key[1] and key[1] != label]


@pytest.mark.parametrize("door", ["sync", "async"])
def test_busy_tries_and_timeouts_are_told_apart_through_both_doors(lock_db, metrics_on, door):
    mine = kind()
    label = f"{mine}:*"
    told: list[dict[str, Any]] = []

    def heard(sender: object, **kwargs: Any) -> None:
        told.append(kwargs)

    holder = acquire(f"{mine}:1", ttl=30)
    # Each call's own duration (monotonic, as ``waited`` is): a call's ``waited`` cannot
    # be longer, and the timed-out one's is at least its timeout. Not a fixed bound such
    # as 0.1 s: an async door's first try also starts its thread's database connection,
    # which takes longer than that on a loaded machine.
    calls: list[float] = []
    kwargs = [{"blocking": False}, {"timeout": 0}, {"timeout": 0.1}]
    signals.lock_not_acquired.connect(heard)
    try:
        if door == "sync":
            outcomes = []
            for options in kwargs:
                began = time.monotonic()
                outcomes.append(acquire(f"{mine}:1", **options))
                calls.append(time.monotonic() - began)
        else:
            async def tries() -> list[Any]:
                got = []
                for options in kwargs:
                    began = time.monotonic()
                    got.append(await aacquire(f"{mine}:1", **options))
                    calls.append(time.monotonic() - began)
                return got

            outcomes = run_async(tries)
    finally:
        signals.lock_not_acquired.disconnect(heard)
        holder.release()
    assert outcomes == [None, None, None]
    assert [event["timed_out"] for event in told] == [False, False, True]
    assert {event["name"] for event in told} == {f"{mine}:1"}
    waited = [event["waited"] for event in told]
    assert all(0 <= w <= call for w, call in zip(waited, calls, strict=True)), (waited, calls)
    assert waited[2] >= 0.1, waited
    assert value("distlock_busy_tries_total", label) == 2.0
    assert value("distlock_timeouts_total", label) == 1.0
    assert value("distlock_leases_held", label) == 0.0


def test_installing_the_app_connects_the_receivers(lock_db):
    mine = kind()
    acquire(f"{mine}:1", ttl=30).release()
    assert value("distlock_grants_total", f"{mine}:*") == 0.0  # not installed: not counted
    try:
        with modify_settings(INSTALLED_APPS={"append": "distlock.contrib.prometheus"}):
            acquire(f"{mine}:2", ttl=30).release()
    finally:
        metrics.disconnect()
    assert value("distlock_grants_total", f"{mine}:*") == 1.0
    assert value("distlock_hold_seconds_count", f"{mine}:*") == 1.0


def test_a_broken_pattern_function_never_fails_a_lock_operation(lock_db, metrics_on, caplog):
    for path in ("tests.test_metrics.not_a_str", "tests.test_metrics.raises"):
        before = value("distlock_grants_total", INVALID)
        with override_settings(DISTLOCK_METRICS_NAME_PATTERN=path):
            lease = acquire(f"{kind()}:1", ttl=30)
            assert lease is not None and lease.release() is True
        assert value("distlock_grants_total", INVALID) == before + 1
    assert "DISTLOCK_METRICS_NAME_PATTERN returned" in caplog.text
    assert "DISTLOCK_METRICS_NAME_PATTERN failed" in caplog.text


@pytest.mark.parametrize(
    ("setting", "check_id", "said"),
    [
        ("tests.test_metrics.no_such_function", "distlock.E030", "does not import"),
        ("no_such_module.pattern", "distlock.E030", "does not import"),
        ("tests.test_metrics.kind", "distlock.E031", "raised TypeError"),
        ("tests.test_metrics.not_a_str", "distlock.E031", "returned 10, not a str"),
        ("tests.test_metrics.raises", "distlock.E031", "raised RuntimeError"),
        ("string.ascii_lowercase", "distlock.E030", "is not callable"),
        (42, "distlock.E030", "must be a dotted path (str), not 42"),
    ],
)
def test_a_bad_pattern_setting_fails_the_system_check(setting, check_id, said):
    assert checks.check_metrics_settings() == []
    with override_settings(DISTLOCK_METRICS_NAME_PATTERN=setting):
        (error,) = checks.check_metrics_settings()
    assert error.id == check_id and said in error.msg
    assert "DISTLOCK_METRICS_NAME_PATTERN" in error.msg and "name_pattern" in error.hint


# --- database-wide gauges (gauges.py) ----------------------------------------------


def gauge_samples(registry: Any) -> dict[str, float]:
    """A scrape of ``registry`` as Prometheus parses it: sample name -> value."""
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def gauge_registry():
    from prometheus_client import CollectorRegistry

    from distlock.contrib.prometheus import gauges

    registry = CollectorRegistry()
    collector = gauges.DatabaseGauges()
    registry.register(collector)
    return registry


def test_database_gauges_count_held_and_expired_locks_at_scrape_time(lock_db, gauge_registry):
    """Issue 34: a dashboard could not show "locks held now". Held and expired (holder
    probably gone) are counted in the database at each scrape; free rows are neither."""
    from django.db import connection

    from distlock.models import Lock

    Lock.objects.bulk_create(Lock(name=f"idle:{i}", token=1) for i in range(20))
    held = [acquire(f"g:held{i}", ttl=600) for i in range(2)]
    gone = expired_lock("g:gone")
    acquire("g:free", ttl=600).release()
    found = gauge_samples(gauge_registry)
    assert found["distlock_locks_held"] == 2
    assert found["distlock_locks_expired"] == 1
    assert found["distlock_gauge_failures_total"] == 0
    if connection.vendor == "postgresql":
        assert found["distlock_sessions_waiting"] == 0  # known: nobody waits
    else:
        # Waiters poll and register nowhere: absent, not a 0 that says nobody waits.
        assert "distlock_sessions_waiting" not in found
    # Read at the scrape, not remembered: a release and a take-over show at the next one.
    held[0].release()
    taken = acquire("g:gone", ttl=600)
    found = gauge_samples(gauge_registry)
    assert (found["distlock_locks_held"], found["distlock_locks_expired"]) == (2, 0)
    assert gone.release() is False and taken.release() is True and held[1].release() is True
    found = gauge_samples(gauge_registry)
    assert (found["distlock_locks_held"], found["distlock_locks_expired"]) == (0, 0)


def test_the_policy_gauge_counts_held_locks_per_lease_policy(lock_db, gauge_registry):
    """Issue 30: the policies in force. Only held locks whose grant has the policy count;
    a lock-delay after a break counts as lock_delay; a caller's own "[min_hold=…]" text
    after the host and pid does not."""
    from prometheus_client import generate_latest

    from distlock import break_lock

    acquire("gp:plain", ttl=600)
    acquire("gp:plain2", ttl=600, holder="[min_hold=5s] not a policy")
    acquire("gp:both", ttl=600, min_hold=5, lock_delay=2)
    acquire("gp:most", ttl=600, max_hold=900)
    acquire("gp:broken", ttl=600, lock_delay=600)
    break_lock("gp:broken")
    acquire("gp:released", ttl=600, lock_delay=2).release()
    expired_lock("gp:expired")  # no policy, and expired
    text = generate_latest(gauge_registry).decode()
    found = {
        sample.labels["policy"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "distlock_locks_held_with_policy"
    }
    assert found == {"min_hold": 1, "max_hold": 1, "lock_delay": 2}


def test_the_leader_gauge_reports_each_elections_term_while_it_leads(lock_db, gauge_registry):
    """Issue 30: the metrics show leaders. One sample per election with a leader now, its
    term, labelled by the name pattern; a plain lock, an expired term and a resigned one
    have none."""
    from prometheus_client import generate_latest

    from distlock.leader import elect

    def terms() -> dict[str, float]:
        text = generate_latest(gauge_registry).decode()
        return {
            sample.labels["election"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "distlock_leader_term"
        }

    scheduler = elect("scheduler", ttl=600)
    warmer = elect("warmer:eu", ttl=600)
    assert scheduler is not None and warmer is not None
    acquire("plain", ttl=600, holder="a leader in name only")
    expired_lock("gone-leader", holder="[leader] expired")
    try:
        assert terms() == {"scheduler": scheduler.token, "warmer:*": warmer.token}
    finally:
        scheduler.resign()
        warmer.resign()
    assert terms() == {}


def test_a_failed_gauge_query_leaves_the_gauges_out_and_the_scrape_answers(
    lock_db, gauge_registry, caplog
):
    """The database down (here: its lock table gone) fails no scrape: the gauges are
    absent from it, the failure counted and logged, and the next good scrape has them."""
    from django.db import connection

    acquire("g:held", ttl=600)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE distlock_lock RENAME TO distlock_lock_away")
    try:
        with caplog.at_level("WARNING", logger="distlock.metrics"):
            found = gauge_samples(gauge_registry)
            again = gauge_samples(gauge_registry)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE distlock_lock_away RENAME TO distlock_lock")
    for scrape_ in (found, again):
        assert "distlock_locks_held" not in scrape_ and "distlock_locks_expired" not in scrape_
        assert "distlock_sessions_waiting" not in scrape_
    assert (found["distlock_gauge_failures_total"], again["distlock_gauge_failures_total"]) \
        == (1, 2)
    assert [r.getMessage() for r in caplog.records] == [
        "distlock gauges: could not read database 'default'"] * 2
    found = gauge_samples(gauge_registry)
    assert found["distlock_locks_held"] == 1 and found["distlock_gauge_failures_total"] == 2


def test_registering_the_gauges_reads_no_database(lock_db):
    """ready() registers the collector before any request: describe(), not a query."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from prometheus_client import CollectorRegistry

    from distlock.contrib.prometheus import gauges

    registry = CollectorRegistry()
    with CaptureQueriesContext(connection) as queries:
        gauges.register(registry)
        gauges.register(registry)  # idempotent
    try:
        assert len(queries) == 0
        assert "distlock_locks_held" in gauge_samples(registry)
    finally:
        gauges.unregister(registry)
        gauges.unregister(registry)
    assert "distlock_locks_held" not in gauge_samples(registry)
