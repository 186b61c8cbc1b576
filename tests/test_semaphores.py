"""Semaphores (distlock/semaphores.py): at most N holders by the database clock, a token
per permit grant strictly increasing per name, a permit fenced like a lease."""

from __future__ import annotations

import asyncio
import signal
import time
from importlib import import_module
from typing import Any

import pytest
from django.db import transaction

from distlock import (
    Lease,
    LockTimeout,
    NestedLock,
    Permit,
    StaleToken,
    TokenExhausted,
    TransactionNotAllowed,
    aacquire_permit,
    acquire_permit,
    asemaphore,
    asemaphore_status,
    current_lease,
    purge_locks,
    semaphore,
    semaphore_status,
    signals,
)
from distlock.constants import MAX_TOKEN
from distlock.core.status import HELD, locks
from distlock.integrations.celery import locked_task as celery_locked_task
from distlock.integrations.tasks import locked_task as tasks_locked_task
from distlock.models import Lock
from distlock.semaphores import MAX_PERMITS
from distlock.testing import make_stale
from tests.settings import TASKS_FRAMEWORK
from tests.stress.harness import HISTORY, drop_triggers, install_triggers, rows
from tests.support.celery_app import DIR_ENV
from tests.support.celery_app import app as celery_app
from tests.support.helpers import run_async, wait_expired
from tests.support.shared_history import check_shared
from tests.testapp.models import Counter, Ledger

pytestmark = pytest.mark.usefixtures("lock_db")

task = import_module(TASKS_FRAMEWORK).task


@celery_app.task(bind=True, name="tests.test_semaphores.celery_limited")
@celery_locked_task("sem:celery", ttl=30, on_contention="skip", limit=2)
def celery_limited(self: Any, *, lease: Any) -> list[Any]:
    return [lease.guard_name, lease.token, current_lease() is lease]


@task(backend="immediate")
@tasks_locked_task("sem:tasks", ttl=30, on_contention="skip", limit=2)
def tasks_limited(*, lease: Any) -> list[Any]:
    return [lease.guard_name, lease.token, current_lease() is lease]

WORKERS = "tests.support.shared_workers:"


def held_rows(name: str) -> list[str]:
    return sorted(
        Lock.objects.filter(name__startswith=f"{name}#permit:").exclude(owner="")
        .values_list("name", flat=True)
    )


def test_n_permits_are_granted_then_the_next_is_refused():
    permits = [acquire_permit("exports", permits=3, ttl=30, blocking=False) for _ in range(3)]
    assert all(isinstance(permit, Permit) for permit in permits)
    assert len({permit.name for permit in permits}) == 3, "two permits on one row"
    assert {permit.guard_name for permit in permits} == {"exports"}
    tokens = [permit.token for permit in permits]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert acquire_permit("exports", permits=3, ttl=30, blocking=False) is None
    assert acquire_permit("exports", permits=3, ttl=30, timeout=0.2) is None
    assert Lock.objects.get(name="exports#permits").token == tokens[-1]
    assert permits[1].release() is True
    again = acquire_permit("exports", permits=3, ttl=30, blocking=False)
    assert again is not None and again.token > tokens[-1]
    assert again.name == permits[1].name, "the one free row below N was not the one taken"
    for permit in (permits[0], permits[2], again):
        assert permit.release() is True
    assert held_rows("exports") == []


def test_tokens_rise_per_semaphore_name_not_per_row():
    """A row granted again gets a token above every permit of the name, not its own + 1."""
    first = acquire_permit("sem:t", permits=2, ttl=30)
    second = acquire_permit("sem:t", permits=2, ttl=30)
    assert first is not None and second is not None
    first.release()
    third = acquire_permit("sem:t", permits=2, ttl=30)
    assert third is not None and third.name == first.name
    assert third.token > second.token > first.token
    second.release()
    third.release()


def rows_taken(name: str, permits: int, grants: int = 20) -> set[str]:
    """The permit rows of ``grants`` grants of ``name``, each released before the next."""
    taken = set()
    for _ in range(grants):
        permit = acquire_permit(name, permits=permits, ttl=30, blocking=False)
        assert permit is not None
        taken.add(permit.name)
        permit.release()
    return taken


def test_after_n_is_lowered_only_rows_below_it_are_granted():
    """The rows at or above a lowered N still count while held, and are never granted
    again: with every row free, twenty grants at N = 2 take rows 0 and 1 only."""
    first = [acquire_permit("sem:low", permits=3, ttl=30) for _ in range(3)]
    for permit in first:
        assert permit is not None
        permit.release()
    assert rows_taken("sem:low", permits=2) <= {"sem:low#permit:0", "sem:low#permit:1"}


def test_grants_spread_over_the_permit_rows():
    """A grant starts at a random free row, so holders do not all meet on row 0 (each
    grant and release locks the row it takes)."""
    assert len(rows_taken("sem:spread", permits=5)) > 1


def test_a_waiter_is_granted_when_the_first_permit_ends_not_the_last(settings):
    """A refused try is told when the first held permit ends, and its next try comes then
    (not after the back-off, set to 10-20 s here, nor at the last permit's end)."""
    settings.DISTLOCK_POLL_INTERVAL = 20
    settings.DISTLOCK_POLL_MAX_INTERVAL = 60
    short = acquire_permit("sem:first", permits=2, ttl=1)
    long = acquire_permit("sem:first", permits=2, ttl=60)
    assert short is not None and long is not None
    started = time.monotonic()
    waiter = acquire_permit("sem:first", permits=2, ttl=30, timeout=30)
    assert waiter is not None and waiter.name == short.name
    assert time.monotonic() - started < 8  # 1 s to the short permit's end, then one try
    waiter.release()
    long.release()


def test_a_permit_taken_over_from_an_expired_holder_says_whose():
    seen = []

    def receiver(sender, lease, took_over="", **kwargs):
        seen.append((lease.name, took_over))

    expired = acquire_permit("sem:over", permits=1, ttl=30, holder="sleepy worker")
    assert expired is not None
    make_stale(expired)
    signals.lock_acquired.connect(receiver)
    try:
        permit = acquire_permit("sem:over", permits=1, ttl=30)
    finally:
        signals.lock_acquired.disconnect(receiver)
    assert permit is not None
    assert seen == [(permit.name, expired.holder)]
    assert expired.holder.endswith("sleepy worker")
    permit.release()


def test_a_semaphore_at_the_last_token_is_exhausted_and_grants_nothing():
    permit = acquire_permit("sem:full", permits=2, ttl=30)
    assert permit is not None
    permit.release()
    Lock.objects.filter(name="sem:full#permits").update(token=MAX_TOKEN)
    with pytest.raises(TokenExhausted):
        acquire_permit("sem:full", permits=2, ttl=30)
    assert not Lock.objects.filter(name__startswith="sem:full").exclude(owner="").exists()


def test_a_purged_semaphore_comes_back_above_its_old_tokens():
    """purge_locks deletes the idle head and permit rows; the name's next grant starts at
    the token floor, above every token it had."""
    permits = [acquire_permit("sem:purged", permits=2, ttl=30) for _ in range(2)]
    for permit in permits:
        assert permit is not None
        permit.release()
    assert purge_locks(idle=0) >= 3
    assert not Lock.objects.filter(name__startswith="sem:purged").exists()
    again = acquire_permit("sem:purged", permits=2, ttl=30)
    assert again is not None and again.token > max(p.token for p in permits)
    again.release()


def test_release_checks_owner_and_token_of_the_permit():
    permit = acquire_permit("sem:r", permits=1, ttl=30)
    assert permit is not None
    forged = Lease(permit.name, permit.owner, permit.token + 1, using="default", ttl=30)
    assert forged.release() is False
    other = Lease(permit.name, "f" * 32, permit.token, using="default", ttl=30)
    assert other.release() is False
    assert held_rows("sem:r") == [permit.name], "a release with another token freed it"
    assert permit.is_current()
    assert permit.release() is True
    assert permit.release() is False


def test_a_stale_permit_can_neither_release_nor_write_after_its_row_is_granted_again():
    counter = Counter.objects.create(key="sem:s", value=0)
    stale = acquire_permit("counter:sem:s", permits=1, ttl=30)
    assert stale is not None
    make_stale(stale)  # paused past its ttl
    fresh = acquire_permit("counter:sem:s", permits=1, ttl=30, blocking=False)
    assert fresh is not None and fresh.name == stale.name and fresh.token > stale.token
    assert stale.release() is False
    assert fresh.is_current(), "the stale holder's release freed the new holder's permit"
    counter.value = 1
    with pytest.raises(StaleToken):
        counter.save(fence=stale)
    counter.value = 2
    counter.save(fence=fresh)
    counter.refresh_from_db()
    assert (counter.value, counter.fence_token) == (2, fresh.token)
    assert fresh.release() is True


def test_a_permit_fences_rows_guarded_by_the_semaphore_name():
    ledger = Ledger.objects.create()
    with semaphore("ledger", permits=2, ttl=30) as permit:
        assert permit.name.startswith("ledger#permit:")
        ledger.save(fence=permit)
        assert Ledger.objects.filter(pk=ledger.pk).fenced_update(permit) == 1
        with semaphore("not-ledger", permits=2, ttl=30) as other, pytest.raises(ValueError):
            ledger.save(fence=other)
    ledger.refresh_from_db()
    assert ledger.fence_token == permit.token


def test_an_expired_permit_nobody_took_over_cannot_write():
    """Current means held by the database clock: unexpired, checked when writing."""
    ledger = Ledger.objects.create()
    permit = acquire_permit("ledger", permits=2, ttl=30)
    assert permit is not None
    make_stale(permit)
    with pytest.raises(StaleToken):
        ledger.save(fence=permit)
    assert not permit.is_current()


def test_a_smaller_n_lets_holders_finish_and_grants_nothing_until_fewer_hold():
    held = {}
    for _ in range(3):
        permit = acquire_permit("sem:n", permits=3, ttl=30)
        assert permit is not None
        held[permit.name] = permit
    # Free row 0: below the new N, so a grant that counted only rows below N would take it.
    held.pop("sem:n#permit:0").release()
    assert acquire_permit("sem:n", permits=2, ttl=30, blocking=False) is None, (
        "N lowered to 2 with 2 holders left, and a third permit was granted"
    )
    held.pop("sem:n#permit:1").release()
    smaller = acquire_permit("sem:n", permits=2, ttl=30, blocking=False)
    assert smaller is not None and smaller.name in ("sem:n#permit:0", "sem:n#permit:1")
    assert acquire_permit("sem:n", permits=2, ttl=30, blocking=False) is None
    larger = acquire_permit("sem:n", permits=3, ttl=30, blocking=False)
    assert larger is not None
    status = semaphore_status("sem:n")
    assert (status.permits, status.held) == (3, 3)
    for permit in (smaller, larger, *held.values()):
        permit.release()


def test_semaphore_block_decorator_nesting_and_current_lease():
    seen: list[Any] = []

    @semaphore("sem:d", permits=2, ttl=30, timeout=1)
    def work() -> None:
        seen.append(current_lease())
        with pytest.raises(NestedLock):
            acquire_permit("sem:d", permits=2, ttl=30)
        with lock_other():
            pass

    work()
    assert isinstance(seen[0], Permit) and seen[0].guard_name == "sem:d"
    assert held_rows("sem:d") == []
    taken = acquire_permit("sem:d2", permits=1, ttl=30)  # no block: another holder's
    with pytest.raises(LockTimeout), semaphore("sem:d2", permits=1, timeout=0):
        pass
    assert taken is not None and taken.release() is True
    with pytest.raises(TypeError):
        semaphore("sem:d", permits=1)(_coroutine)


def lock_other() -> Any:
    from distlock import lock

    return lock("sem:d", ttl=30)  # a plain lock of the same name: other rows, not nested


async def _coroutine() -> None:
    pass


def test_nested_permit_raises_at_once():
    with semaphore("sem:x", permits=5, ttl=30), pytest.raises(NestedLock):
        acquire_permit("sem:x", permits=5, ttl=30)


def test_bad_input_is_refused_before_any_sql():
    for permits in (0, -1, MAX_PERMITS + 1):
        with pytest.raises(ValueError):
            acquire_permit("sem:b", permits=permits)
    for permits in (True, "3", 2.0, None):
        with pytest.raises(TypeError):
            acquire_permit("sem:b", permits=permits)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        acquire_permit("x" * 250, permits=1)
    with pytest.raises(TypeError):
        semaphore(3, permits=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        semaphore("sem:b", permits=1, ttl=-1)
    assert not Lock.objects.filter(name__startswith="sem:b").exists()


def test_refused_inside_the_callers_transaction():
    with transaction.atomic(), pytest.raises(TransactionNotAllowed):
        acquire_permit("sem:a", permits=1, ttl=30)
    assert not Lock.objects.filter(name__startswith="sem:a#permit").exists()


def test_status_agrees_with_the_admins_view_of_the_rows():
    first = acquire_permit("sem:st", permits=3, ttl=30, holder="one")
    second = acquire_permit("sem:st", permits=3, ttl=30, holder="two")
    assert first is not None and second is not None
    make_stale(second)
    with transaction.atomic():  # a plain read: fine inside the caller's transaction
        status = semaphore_status("sem:st")
    admin = {row.name: row for row in locks("default").filter(name__startswith="sem:st#permit:")}
    assert {name for name, row in admin.items() if row.state == HELD} == {first.name}
    assert (status.permits, status.held, status.token) == (3, 1, second.token)
    (holder,) = status.holders
    row = admin[first.name]
    assert (holder.name, holder.owner, holder.token, holder.holder) == (
        row.name, row.owner, row.token, row.holder)
    assert "one" in holder.holder and 0 < holder.remaining <= 30
    assert run_async(lambda: asemaphore_status("sem:st")).held == 1
    empty = semaphore_status("sem:none")
    assert (empty.permits, empty.held, empty.token, empty.holders) == (None, 0, 0, ())
    first.release()


def test_async_twins():
    async def main() -> list[int]:
        two = await aacquire_permit("sem:as", permits=2, ttl=30, timeout=1)
        assert two is not None
        async with asemaphore("sem:as", permits=2, ttl=30, timeout=1) as one:
            assert current_lease() is one
            # Another task: not nested, and it finds both permits held.
            third = asyncio.ensure_future(
                aacquire_permit("sem:as", permits=2, ttl=30, blocking=False))
            assert await third is None
            assert await two.arelease() is True
            return [two.token, one.token]

    tokens = run_async(main)
    assert tokens[1] > tokens[0]
    assert held_rows("sem:as") == []


def test_the_permit_of_another_lock_in_a_semaphore_name_is_not_nested():
    with acquire_ctx("sem:p"):
        permit = acquire_permit("sem:p", permits=1, ttl=30, blocking=False)
        assert permit is not None
        permit.release()


def acquire_ctx(name: str) -> Any:
    from distlock import lock

    return lock(name, ttl=30)


@pytest.mark.processes
def test_n_holders_at_most_under_pauses_and_kills(children):
    """Five processes cycle a 3-permit semaphore while one holder is SIGSTOPped past its
    ttl and another SIGKILLed: by the database's own history never more than 3 holders,
    tokens strictly rising per name, and the paused holder, woken, has its fenced write
    and its release refused."""
    name, ttl = "counter:sem:p", 1.0
    Counter.objects.create(key="sem:p", value=0)
    install_triggers()
    try:
        # Everyone started and connected first, so the two holders' permits (3 s) are
        # surely still held when the cyclers start: 3 holders at once, by construction.
        paused, killed = (children.start(WORKERS + "hold_permit", name, 3, 3.0)
                          for _ in range(2))
        cyclers = [children.start(WORKERS + "cycle_permits", name, 3, ttl, 12)
                   for _ in range(4)]
        for child in (paused, killed, *cyclers):
            child.expect("ready", timeout=60)
        paused.send("go")
        row = paused.expect("acquired", timeout=60)["row"]
        paused.signal(signal.SIGSTOP)
        killed.send("go")
        killed.expect("acquired", timeout=60)
        killed.signal(signal.SIGKILL)
        for cycler in cyclers:
            cycler.send("go")
        for cycler in cyclers:
            cycler.expect("done", timeout=120)
        wait_expired(row, timeout=30)  # the paused holder's permit, by the database clock
        paused.signal(signal.SIGCONT)
        paused.send("write")
        assert paused.expect("wrote", timeout=30)["refused"] is True
        paused.send("release")
        assert paused.expect("released", timeout=30)["held"] is False
        history = rows(HISTORY)
    finally:
        drop_triggers()
    report = check_shared(history, name, limit=3, members=f"{name}#permit:")
    assert report.grants >= 4 * 12 + 2, report
    assert report.ok, report.violations
    assert report.most_at_once == 3, "the run never had 3 holders: it showed nothing"


@pytest.mark.parametrize("runner", ["celery", "tasks"])
def test_locked_task_with_a_limit_runs_under_a_permit(runner, monkeypatch, tmp_path):
    name = f"sem:{runner}"
    monkeypatch.setenv(DIR_ENV, str(tmp_path))  # the suite's Celery app records contention

    def run() -> Any:
        if runner == "celery":
            return celery_limited.apply().get()
        return tasks_limited.enqueue().return_value

    taken = [acquire_permit(name, permits=2, ttl=30) for _ in range(2)]
    assert run() is None, "a third run beside two permits held"
    assert taken[0] is not None and taken[0].release()
    guard, token, current = run()
    assert (guard, current) == (name, True) and token > taken[1].token
    assert held_rows(name) == [taken[1].name]
    assert taken[1].release()
    for bad, error in ((0, ValueError), ("2", TypeError)):
        with pytest.raises(error):
            celery_locked_task("x", limit=bad)
        with pytest.raises(error):
            tasks_locked_task("x", limit=bad)
