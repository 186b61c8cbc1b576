"""distlock.periodic.periodic_once: a job's body at most once per period, on every backend.

The period a fire counts for is read from the database clock, so hosts whose clocks are
half a minute apart agree on it; a fire counts for the scheduled instant nearest to it, so a
fire up to half a period early or late still finds its period claimed.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections

from distlock import current_lease
from distlock.db import db_now_us
from distlock.models import Lock
from distlock.periodic import nearest_instant, periodic_once
from tests.support.helpers import wait_until
from tests.support.processes import LIBFAKETIME, skewed_clock_env

pytestmark = pytest.mark.django_db(transaction=True)

EVERY = 4.0
EVERY_US = round(EVERY * 1e6)


def _now() -> int:
    return db_now_us("default")


def _wait_past(moment_us: int, what: str) -> None:
    """Wait until the database clock reads ``moment_us`` or later."""
    wait_until(lambda: _now() >= moment_us, what=what)


def _phase_for(instant_from_now_us: int) -> float:
    """``at`` (seconds) that puts a scheduled instant ``instant_from_now_us`` from the
    database's now."""
    return ((_now() + instant_from_now_us) % EVERY_US) / 1e6


def _counting(name: str, at: float, **options: Any) -> tuple[Callable[[], Any], list[Any]]:
    runs: list[Any] = []

    @periodic_once(name, every=EVERY, at=at, **options)
    def job() -> Any:
        lease = current_lease()
        assert lease is not None
        runs.append((lease.name, lease.token))
        return lease

    return job, runs


def test_nearest_instant_is_the_scheduled_instant_nearest_to_now():
    every, at = 4_000_000, 1_000_000
    assert nearest_instant(9_000_000, every, at) == 9_000_000
    assert nearest_instant(10_999_999, every, at) == 9_000_000
    assert nearest_instant(11_000_000, every, at) == 13_000_000  # halfway: the later
    assert nearest_instant(7_000_001, every, at) == 9_000_000
    assert nearest_instant(7_000_000, every, at) == 9_000_000
    assert nearest_instant(6_999_999, every, at) == 5_000_000


def test_fires_early_and_late_within_half_a_period_run_the_body_once(lock_db):
    """A fire 1.6 s before a scheduled instant runs the body; a second at once, and one
    1.2 s after the instant, find the period claimed (the lock was neither released after
    the run nor given a lease shorter than the period); a fire past the halfway point runs
    it again, for the next instant.

    The halfway point is a deadline: a fire that the machine delayed past it would count
    for the next period, so an attempt whose late fire may have crossed it (by the database
    clock read after it) is not conclusive and is made again with a fresh name.
    """
    for attempt in range(5):
        name = f"periodic:late:{attempt}"
        at = _phase_for(1_600_000)
        instant = nearest_instant(_now() + 1_600_000, EVERY_US, round(at * 1e6))
        job, runs = _counting(name, at)
        assert job() is not None
        assert job() is None
        late_at, halfway = instant + 1_200_000, instant + EVERY_US // 2
        _wait_past(late_at, "1.2 s past the instant")
        late = job()
        if _now() >= halfway:
            continue  # the late fire may have counted for the next instant: not conclusive
        assert late is None, "a fire 1.2 s late ran the body again in the same period"
        _wait_past(halfway + 1, "past halfway")
        assert job() is not None
        (first, token_1), (second, token_2) = runs
        assert first.startswith(f"{name}@") and second.startswith(f"{name}@")
        assert first != second and token_1 >= 1 and token_2 >= 1
        return
    pytest.fail("the machine never fired within the deadlines of this test")


def test_a_body_that_raises_has_used_its_period(lock_db):
    at = _phase_for(0)

    @periodic_once("periodic:raises", every=EVERY, at=at)
    def job() -> None:
        raise RuntimeError("the job failed")

    with pytest.raises(RuntimeError, match="the job failed"):
        job()
    assert job() is None


def test_the_run_holds_its_period_lock_for_the_ttl_asked(lock_db):
    at = _phase_for(0)
    job, runs = _counting("periodic:fence", at, ttl=30, holder="nightly on host-a")
    lease = job()
    assert lease is not None and lease.is_current()
    row = Lock.objects.get(name=lease.name)
    assert (row.owner, row.token) == (lease.owner, lease.token)
    assert row.holder.endswith("nightly on host-a")
    assert lease.remaining() > 25  # the ttl asked for, not the period
    assert current_lease() is None  # only inside the body


@pytest.mark.parametrize(
    "options, error",
    [
        ({"every": 0.5}, ValueError),
        ({"every": "60"}, TypeError),
        ({"every": float("nan")}, ValueError),
        ({"every": timedelta(minutes=1), "ttl": 59}, ValueError),
        ({"every": 60, "at": "0"}, TypeError),
        ({"every": 60, "holder": "a\x00b"}, ValueError),
        ({"every": 60, "using": "nowhere"}, ValueError),
        ({"every": 60, "ttl": 10**6}, ValueError),  # above DISTLOCK_MAX_TTL
        ({"every": 10**20}, ValueError),
    ],
)
def test_bad_arguments_are_refused_at_decoration_and_write_nothing(lock_db, options, error):
    before = Lock.objects.count()
    with pytest.raises(error):
        periodic_once("periodic:bad", **options)(lambda: None)
    assert Lock.objects.count() == before


def test_a_name_too_long_for_its_period_locks_and_an_async_job_are_refused(lock_db):
    with pytest.raises(ValueError, match="too long for a periodic job"):
        periodic_once("n" * 231, every=60)
    periodic_once("n" * 230, every=60)  # 230 + "@2026-12-04T15:00:00.000Z" = 255

    async def job() -> None:
        pass

    with pytest.raises(TypeError):
        periodic_once("periodic:async", every=60)(job)


@pytest.mark.processes
@pytest.mark.skipif(LIBFAKETIME is None, reason="needs libfaketime (Debian package faketime)")
def test_hosts_half_a_minute_apart_run_each_period_once(children, lock_db):
    """Three hosts whose clocks read 30 s behind, right and 30 s ahead each get the job
    at the same moment (as a broker delivers the tasks that every host's beat enqueued),
    in two periods: each period's body runs once, on one host. Judged by the hosts'
    clocks, each would count the fire for another instant (30 s is 7.5 periods of 4 s)
    and run it."""
    if connections["default"].vendor == "sqlite":
        pytest.skip(
            "SQLite has no server clock: each process reads its host's clock, which all "
            "processes on the one host SQLite requires share (see README, limits)"
        )
    at = _phase_for(EVERY_US // 2 + 500_000)  # a period's middle is half a second ahead
    hosts = [
        children.start("tests.support.periodic_workers:job", "periodic:hosts", EVERY, at,
                       env=skewed_clock_env(skew))
        for skew in ("-30s", "+0s", "+30s")
    ]
    walls = [host.expect("ready", timeout=60)["wall"] for host in hosts]
    assert walls[2] - walls[0] > 55, "faketime did not skew the hosts' clocks"
    ran: list[dict[str, Any]] = []
    for period in range(2):
        start = _now()
        for host in hosts:
            host.send("fire")
        fired = [host.expect("fired", timeout=60)["ran"] for host in hosts]
        end = _now()
        assert nearest_instant(start, EVERY_US, round(at * 1e6)) == nearest_instant(
            end, EVERY_US, round(at * 1e6)
        ), "the fires straddled a halfway point: not conclusive"
        runs = [run for run in fired if run is not None]
        assert len(runs) == 1, (period, fired)
        ran += runs
        # The next period's fires: once the database clock is past this one's halfway.
        next_fires = nearest_instant(end, EVERY_US, round(at * 1e6)) + EVERY_US // 2 + 200_000
        _wait_past(next_fires, "the next period")
    assert ran[0]["lock"] != ran[1]["lock"], ran
    for host in hosts:
        host.send("exit")
        assert host.finish() == 0


def test_a_fire_inside_the_callers_transaction_is_refused_and_claims_nothing(lock_db):
    """Inside atomic() on the lock's database a fire is refused as acquire is (the claim
    would commit or roll back with the caller's work): the body does not run, no period
    is claimed, and the same fire outside the transaction then runs it."""
    from django.db import transaction

    from distlock import TransactionNotAllowed

    job, runs = _counting("periodic:atomic", _phase_for(0))
    before = Lock.objects.count()
    with pytest.raises(TransactionNotAllowed), transaction.atomic():
        job()
    assert runs == [] and Lock.objects.count() == before
    assert job() is not None and len(runs) == 1
