"""lock_all(), acquire_all() and their async twins: several names, all or nothing."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest

from distlock import (
    LeaseGroup,
    LockTimeout,
    NestedLock,
    StaleToken,
    aacquire_all,
    acquire,
    acquire_all,
    alock,
    alock_all,
    break_lock,
    lock,
    lock_all,
    signals,
)
from distlock.db import db_now_us
from distlock.models import Lock
from tests.factories import AccountFactory
from tests.support.helpers import run_async, run_with_deadline, start_thread, wait_until

pytestmark = pytest.mark.usefixtures("lock_db")

GROUPS = "tests.support.group_workers:"
# Grants per process in the opposite-orders test (two processes: twice this in all).
# PostgreSQL and SQLite run 500 each in well under 60 s on two shared cores; MariaDB too.
CYCLES = int(os.environ.get("DISTLOCK_TEST_GROUP_CYCLES", "500"))


def held_names() -> set[str]:
    """The names whose rows have an owner (held, perhaps expired: the ttls here are long)."""
    return set(Lock.objects.exclude(owner="").values_list("name", flat=True))


def test_one_lease_per_name_taken_in_the_order_of_the_names_bytes():
    granted: list[str] = []

    def record(lease: Any, **kwargs: Any) -> None:
        granted.append(lease.name)

    signals.lock_acquired.connect(record, weak=False)
    try:
        group = acquire_all(["é", "z", "Z", "a"], ttl=30)
    finally:
        signals.lock_acquired.disconnect(record)
    assert isinstance(group, LeaseGroup)
    assert granted == ["Z", "a", "z", "é"] == list(group)  # UTF-8 bytes: 5A 61 7A C3A9
    for name, lease in group.items():
        row = Lock.objects.get(name=name)
        assert (lease.name, lease.owner, lease.token) == (name, row.owner, row.token)
    assert len({lease.owner for lease in group.leases}) == 4
    assert group.tokens == {name: lease.token for name, lease in group.items()}
    assert 29 < group.remaining() <= 30
    assert group.release() is True
    assert held_names() == set()
    assert group.release() is False  # twice: a no-op that says so


def test_lock_all_releases_every_member_at_the_end_of_the_block():
    with lock_all(("b", "a"), ttl=30, timeout=1) as group:
        assert held_names() == {"a", "b"}
        with lock("c", ttl=30):  # another name is not nested
            pass
    assert held_names() == set()
    assert all(lease.released_at is not None for lease in group.leases)


def test_a_name_held_elsewhere_makes_the_group_hold_nothing(children):
    holder = children.start("hold", "b", 60.0)
    holder.expect("acquired", timeout=60)
    assert acquire_all(["c", "b", "a"], ttl=30, blocking=False) is None
    assert acquire_all(["c", "b", "a"], ttl=30, timeout=0.2) is None
    with pytest.raises(LockTimeout) as caught, lock_all(["c", "b", "a"], ttl=30, timeout=0.2):
        pass
    assert caught.value.name == "b"
    assert held_names() == {"b"}, "a refused group kept a name"
    holder.send("release")
    assert holder.expect("released")["held"] is True
    group = acquire_all(["c", "b", "a"], ttl=30, blocking=False)
    assert group is not None and list(group) == ["a", "b", "c"]
    group.release()


def test_waiting_holds_the_names_before_the_busy_one_and_none_after(children):
    holder = children.start("hold", "b", 60.0)
    holder.expect("acquired", timeout=60)
    got: dict[str, Any] = {}
    thread = start_thread(lambda: got.update(group=acquire_all(["c", "b", "a"], timeout=60)))
    try:
        wait_until(lambda: held_names() == {"a", "b"}, timeout=20, what="a taken, b waited for")
        assert "group" not in got
        assert held_names() == {"a", "b"}, "c was taken while b was busy"
        holder.send("release")
        holder.expect("released")
    finally:
        thread.join(60)
    group = got["group"]
    assert group is not None and held_names() == {"a", "b", "c"}
    group.release()


def test_a_member_left_short_by_the_wait_is_renewed_once_the_last_name_is_granted():
    """The first member, held while the group waits for the busy second name, is left with
    less than half its ttl: it is renewed (same token) once the last name is granted, so
    the group does not start with a member about to lapse."""
    ttl = 8.0
    busy = acquire("rn:b", ttl=60)
    got: dict[str, Any] = {}
    thread = start_thread(
        lambda: got.update(group=acquire_all(["rn:b", "rn:a"], ttl=ttl, timeout=30)))
    try:
        first = wait_until(lambda: Lock.objects.filter(name="rn:a").exclude(owner="").first(),
                           what="rn:a taken")
        # Under half its ttl left by the database clock (by the lease's own, conservative
        # clock less still), with seconds to spare before it lapses.
        wait_until(lambda: first.expires_us - db_now_us("default") < (ttl / 2 - 0.3) * 1e6,
                   timeout=20, what="rn:a past half its ttl")
        assert "group" not in got
        assert busy.release() is True
    finally:
        thread.join(30)
    group = got["group"]
    row = Lock.objects.get(name="rn:a")
    assert group["rn:a"].token == first.token == row.token, "rn:a lapsed: the group restarted"
    assert row.renew_count == 1 and row.expires_us > first.expires_us, "rn:a was not renewed"
    assert group.remaining() > ttl / 2
    assert group.release() is True


@pytest.mark.processes
def test_opposite_orders_in_two_processes_never_deadlock_or_overlap(children):
    """Two processes lock {x, y} as [x, y] and [y, x], CYCLES times each.

    Each group waits at most 20 s and its leases live 60 s: a deadlock (each holding one
    name, waiting for the other) ends in a LockTimeout, an error event, long before a
    lease could expire. Afterwards: each name's tokens are unique and contiguous, its
    leases disjoint by the database clock, and both names were granted in one order of
    groups (the group that got x first got y first).
    """
    forward = children.start(GROUPS + "cycle_group", ["x", "y"], CYCLES, 60.0, 20.0)
    backward = children.start(GROUPS + "cycle_group", ["y", "x"], CYCLES, 60.0, 20.0)
    for proc in (forward, backward):
        proc.expect("ready", timeout=60)
    for proc in (forward, backward):
        proc.send("go")
    grants = []
    for proc in (forward, backward):
        grants.extend(proc.expect("done", timeout=180)["grants"])
        assert proc.finish() == 0
    assert len(grants) == 2 * CYCLES
    for name in ("x", "y"):
        ordered = sorted(grants, key=lambda grant: grant[name][0])
        tokens = [grant[name][0] for grant in ordered]
        assert tokens == list(range(tokens[0], tokens[0] + len(tokens))), name
        for earlier, later in zip(ordered, ordered[1:], strict=False):
            assert earlier[name][2] is not None, "a member was not released"
            assert later[name][1] >= earlier[name][2], f"{name}: {earlier} overlaps {later}"
    by_x = sorted(grants, key=lambda grant: grant["x"][0])
    assert by_x == sorted(grants, key=lambda grant: grant["y"][0]), "groups interleaved"


def test_fenced_write_takes_its_own_names_member_and_refuses_it_after_a_takeover():
    first, second = AccountFactory(), AccountFactory()
    name_1, name_2 = f"account:{first.pk}", f"account:{second.pk}"
    with lock_all([name_2, name_1], ttl=30, timeout=5) as group:
        first.balance = 10
        first.save(fence=group[name_1])
        second.balance = 20
        second.save(fence=group[name_2])
        with pytest.raises(ValueError, match=f"guarded by lock '{name_1}'"):
            first.save(fence=group[name_2])
        assert break_lock(name_1)
        newer = run_with_deadline(lambda: acquire(name_1, ttl=30))  # another holder
        assert newer is not None and newer.token > group[name_1].token
        first.balance = 99
        with pytest.raises(StaleToken):
            first.save(fence=group[name_1])
        second.balance = 21
        second.save(fence=group[name_2])  # the other member is still current
        first.refresh_from_db()
        assert first.balance == 10
        first.balance = 11
        first.save(fence=newer)
    assert group[name_1].lost
    second.refresh_from_db()
    assert second.balance == 21
    assert held_names() == {name_1}  # the newer holder's, untouched by the group's end
    newer.release()


def test_nested_names_raise_nested_lock_at_once():
    with lock("x", ttl=30), pytest.raises(NestedLock):
        lock_all(["y", "x"], ttl=30).__enter__()
    assert held_names() == set()
    with lock_all(["x", "y"], ttl=30) as group:
        for attempt in (
            lambda: lock("y").__enter__(),
            lambda: lock_all(["z", "y"]).__enter__(),
            lambda: acquire_all(["x"]),
            lambda: acquire("x"),
        ):
            with pytest.raises(NestedLock):
                attempt()
        assert held_names() == {"x", "y"}
    with lock("y", ttl=30) as lease:  # free again once the block is over
        assert lease.token > group["y"].token


@pytest.mark.parametrize(
    ("names", "error", "match"),
    [
        ([], ValueError, "at least one"),
        (["a", "b", "a"], ValueError, "must not repeat"),
        (["a", ""], ValueError, "must not be empty"),
        (["a", 5], TypeError, "must be a str"),
        (["a", "x" * 10_000], ValueError, "characters long"),
        (5, TypeError, "collection of lock names"),
        (None, TypeError, "collection of lock names"),
        ("ab", TypeError, "single str"),
        (b"ab", TypeError, "single bytes"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(names, error, match):
    for attempt in (
        lambda: acquire_all(names, ttl=30),
        lambda: lock_all(names, ttl=30),
        lambda: run_async(lambda: aacquire_all(names, ttl=30)),
        lambda: alock_all(names, ttl=30),
    ):
        with pytest.raises(error, match=match):
            attempt()
    assert not Lock.objects.exists()


def test_bad_options_are_refused_before_anything_is_written():
    with pytest.raises(ValueError):
        acquire_all(["a", "b"], ttl=-1)
    with pytest.raises(ValueError):
        lock_all(["a", "b"], timeout=-1)
    with pytest.raises(TypeError):
        acquire_all(["a", "b"], blocking="no")  # type: ignore[arg-type]
    assert not Lock.objects.exists()


def test_a_failed_release_does_not_stop_the_others_and_is_raised():
    def broken() -> bool:
        raise RuntimeError("release failed")

    with pytest.raises(RuntimeError, match="release failed"):  # noqa: SIM117
        with lock_all(["a", "b", "c"], ttl=30) as group:
            group["b"].release = broken  # type: ignore[method-assign]
    assert held_names() == {"b"}
    del group["b"].release
    assert group["b"].release() is True


def test_waiting_threads_with_opposite_orders_finish():
    """The same property as the process test, between threads of one process (its
    per-name queue of waiters): 50 groups each, no deadlock, never both inside."""
    inside = threading.Lock()
    errors: list[BaseException] = []

    def run(names: list[str]) -> None:
        try:
            for _ in range(50):
                with lock_all(names, ttl=60, timeout=20):
                    assert inside.acquire(blocking=False), "two groups inside at once"
                    inside.release()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [start_thread(lambda: run(["p", "q"])), start_thread(lambda: run(["q", "p"]))]
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []


# -- async twins ---------------------------------------------------------------------------


def test_alock_all_gives_and_releases_the_group():
    async def body() -> LeaseGroup:
        async with alock_all(["b", "a"], ttl=30, timeout=5) as group:
            assert list(group) == ["a", "b"]
            stored = {row.name: row.token async for row in Lock.objects.exclude(owner="")}
            assert stored == group.tokens
        return group

    group = run_async(body)
    assert held_names() == set()
    assert all(lease.released_at is not None for lease in group.leases)


def test_aacquire_all_holds_nothing_when_a_name_is_busy_and_gives_back_on_cancel():
    other = acquire("b", ttl=60)
    assert other is not None

    async def body() -> None:
        assert await aacquire_all(["c", "b", "a"], ttl=30, timeout=0.2) is None
        with pytest.raises(LockTimeout):
            async with alock_all(["c", "b", "a"], ttl=30, timeout=0):
                pass
        assert {n async for n in Lock.objects.exclude(owner="").values_list("name", flat=True)} \
            == {"b"}
        waiting = asyncio.ensure_future(aacquire_all(["c", "b", "a"], ttl=30, timeout=30))
        async with asyncio.timeout(20):
            while not await Lock.objects.filter(name="a").exclude(owner="").aexists():
                await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    run_async(body)
    assert held_names() == {"b"}, "a cancelled group kept a name"
    other.release()


def test_async_fenced_write_and_nesting():
    account = AccountFactory()
    name = f"account:{account.pk}"

    async def body() -> None:
        async with alock("n", ttl=30):
            with pytest.raises(NestedLock):
                await aacquire_all(["n", name], ttl=30)
        async with alock_all([name, "n"], ttl=30) as group:
            with pytest.raises(NestedLock):
                async with alock("n"):
                    pass
            account.balance = 5
            await account.asave(fence=group[name])
            await group.arenew()
            assert await group[name].ais_current()

    run_async(body)
    account.refresh_from_db()
    assert account.balance == 5
    assert held_names() == set()


# -- seams: a killed holder, auto-renewal, the decorator, the session's own timeouts ------


@pytest.mark.processes
def test_a_killed_holder_of_a_member_is_waited_out_and_its_name_granted_above_its_token(
    children,
):
    """The holder of b dies (SIGKILL) without releasing: the group waits for its lease to
    end by the database clock, never before, then holds a and b, b with the next token."""
    holder = children.start("hold", "b", 1.0)
    killed = holder.expect("acquired", timeout=60)
    holder.kill()
    group = acquire_all(["b", "a"], ttl=30, timeout=30)
    assert group is not None
    assert group["b"].token == killed["token"] + 1
    row = Lock.objects.get(name="b")
    assert row.acquired_us >= killed["expires_us"], "granted before the dead lease ended"
    assert group.release() is True


def test_auto_renew_keeps_every_member_past_its_ttl():
    with lock_all(["r:a", "r:b"], ttl=1, timeout=5, auto_renew=True) as group:
        wait_until(
            lambda: all(row.renew_count >= 2 for row in Lock.objects.filter(name__in=group)),
            timeout=10, what="both members renewed twice",
        )
        assert not group.lost and group.remaining() > 0
        rows = {row.name: row for row in Lock.objects.filter(name__in=group)}
        assert {name: rows[name].token for name in group} == group.tokens
    assert held_names() == set()


def test_the_decorator_holds_the_group_for_each_call_and_gives_it_back():
    seen: list[set[str]] = []

    @lock_all(["d:b", "d:a"], ttl=30, timeout=5)
    def work(n: int) -> int:
        seen.append(held_names())
        return n + 1

    assert work(1) == 2 and work(2) == 3
    assert seen == [{"d:a", "d:b"}, {"d:a", "d:b"}]
    assert held_names() == set()


SHORT_STATEMENTS = {
    "postgresql": ("SET statement_timeout = '50ms'", "RESET statement_timeout"),
    "mysql": ("SET SESSION max_statement_time = 0.05", "SET SESSION max_statement_time = 0"),
}


def test_a_session_statement_timeout_shorter_than_the_wait_still_ends_in_lock_timeout(
    children,
):
    """The caller's own statement timeout (50 ms) is shorter than the group's wait (1 s)
    for a busy member: the wait is distlock's, not one long statement, so the group ends
    in LockTimeout naming the busy name, holding nothing, the session usable."""
    from django.db import connection

    if connection.vendor not in SHORT_STATEMENTS:
        pytest.skip("a session statement timeout: PostgreSQL and MariaDB")
    short, back = SHORT_STATEMENTS[connection.vendor]
    holder = children.start("hold", "busy", 60.0)
    holder.expect("acquired", timeout=60)
    with connection.cursor() as cursor:
        cursor.execute(short)
    try:
        with pytest.raises(LockTimeout) as caught, lock_all(["free", "busy"], ttl=30,
                                                            timeout=1):
            pass
        assert caught.value.name == "busy"
        assert held_names() == {"busy"}
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            assert cursor.fetchone() == (1,)
    finally:
        with connection.cursor() as cursor:
            cursor.execute(back)
    holder.send("release")
    holder.expect("released")
