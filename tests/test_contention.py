"""Mutual exclusion, crashes, clock skew and lock waits, with real OS processes."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from django.db import connections, transaction

from distlock import acquire, db, lock
from distlock.backends import backend_for
from distlock.conf import conf
from distlock.constants import LOCK_TABLE as TABLE
from distlock.db import db_now_us
from distlock.exceptions import TransactionNotAllowed
from distlock.models import Lock
from distlock.waiting.queue import queued
from tests.support.helpers import start_thread, wait_until
from tests.support.pgbouncer import QUEUE_CLASS, WAKEUP_CLASS
from tests.support.processes import LIBFAKETIME, skewed_clock_env

pytestmark = pytest.mark.processes

WORKERS = 8
GRANTS_EACH = 25


def test_processes_hammering_one_name_never_overlap(children):
    """8 processes × 25 grants: tokens contiguous and unique, leases disjoint in DB time."""
    procs = [
        children.start("hammer", "hammer", GRANTS_EACH, 10.0, 3.0) for _ in range(WORKERS)
    ]
    for proc in procs:
        proc.expect("ready", timeout=60)
    for proc in procs:
        proc.send("go")
    grants = []
    for proc in procs:
        for _ in range(GRANTS_EACH):
            grants.append(proc.expect("grant", timeout=120))
        proc.expect("done", timeout=30)
        assert proc.finish() == 0

    grants.sort(key=lambda grant: grant["token"])
    tokens = [grant["token"] for grant in grants]
    assert len(tokens) == WORKERS * GRANTS_EACH
    assert tokens == list(range(tokens[0], tokens[0] + len(tokens))), "tokens skipped or repeated"
    assert all(grant["held"] for grant in grants), "a holder lost its lease before releasing"
    for earlier, later in zip(grants, grants[1:], strict=False):
        end = min(earlier["released_us"], earlier["expires_us"])
        assert later["acquired_us"] >= end, f"leases overlap: {earlier} and {later}"
    assert len({grant["pid"] for grant in grants}) == WORKERS


def test_killed_holder_blocks_others_for_at_most_its_ttl(children):
    ttl = 2.0
    holder = children.start("hold", "crash", ttl)
    held = holder.expect("acquired", timeout=60)
    waiter = children.start("wait_for", "crash", 30.0, 15.0)
    waiter.expect("ready", timeout=60)
    killed_at = db_now_us("default")
    holder.signal(signal.SIGKILL)
    waiter.send("go")
    got = waiter.expect("acquired", timeout=30)
    assert got["token"] > held["token"]
    assert got["acquired_us"] >= held["expires_us"], "granted before the dead holder's expiry"
    assert got["acquired_us"] - killed_at <= (ttl + 1.0) * 1e6, "waited longer than ttl + 1 s"


def test_stale_holder_release_and_renew_are_noops(children):
    stale = children.start("hold", "stale", 0.5)
    old = stale.expect("acquired", timeout=60)
    fresh = acquire("stale", ttl=30, timeout=10)
    assert fresh is not None and fresh.token == old["token"] + 1
    before = Lock.objects.values().get(name="stale")

    stale.send("renew")
    assert "taken over" in stale.expect("lost")["reason"]
    stale.send("release")
    assert stale.expect("released")["held"] is False

    assert Lock.objects.values().get(name="stale") == before
    assert fresh.release() is True


@pytest.mark.skipif(LIBFAKETIME is None, reason="needs libfaketime (Debian package faketime)")
@pytest.mark.parametrize("skew", ["+30s", "-30s"])
def test_client_clock_skew_changes_nothing(children, skew):
    """A holder and a contender whose wall clocks are off by ±30 s, in opposite directions.

    The lease lives 20 s: less than either skew, so judging expiry by the contender's
    clock (60 s ahead of the holder's, or 30 s ahead of the server's) or the holder's
    remaining time by its own would fail, and far more than the few steps from the grant
    to the contender's try — which is made only after the contender has started and
    connected (a loaded machine can take seconds to start a process).
    """
    if connections["default"].vendor == "sqlite":
        pytest.skip(
            "SQLite has no server clock: each process reads its host's clock, which all "
            "processes on the one host SQLite requires share (see README, limits)"
        )
    other = "-30s" if skew == "+30s" else "+30s"
    contender = children.start("try_once", "skew", 20.0, env=skewed_clock_env(other))
    contender.expect("ready", timeout=60)
    started = time.time()
    holder = children.start("hold", "skew", 20.0, env=skewed_clock_env(skew))
    held = holder.expect("acquired", timeout=60)
    seen = time.time()
    # Read between this process's two readings of its own clock, shifted by the skew.
    assert started - 1 < held["wall"] - int(skew[:-1]) < seen + 1, "faketime did not skew"

    contender.send("go")
    assert contender.expect("busy", timeout=60), "a skewed clock took an unexpired lock"
    holder.send("remaining")
    assert holder.expect("remaining")["remaining"] > 0, "the holder lost its lease early"
    holder.send("renew")
    assert holder.expect("renewed")["token"] == held["token"]
    holder.send("release")
    assert holder.expect("released")["held"] is True


def test_grant_after_a_row_lock_wait_is_not_expired_at_birth(lock_db):
    """The frozen now() trap: the acquire waits on the row lock longer than its ttl."""
    acquire("frozen", ttl=30).release()
    blocker = connections.create_connection("default")
    blocked = threading.Event()
    outcome = []

    def wait_then_acquire():
        blocked.wait(10)
        outcome.append(acquire("frozen", ttl=0.5, timeout=20))
        connections.close_all()

    # Hold the lock row (or SQLite's write lock) in another connection for 1.5 s (3× ttl).
    blocker.set_autocommit(False)
    with blocker.cursor() as cursor:
        if blocker.vendor != "sqlite":
            cursor.execute(f"SELECT token FROM {TABLE} WHERE name = %s FOR UPDATE", ["frozen"])
        else:
            cursor.execute(f"UPDATE {TABLE} SET holder = holder WHERE name = %s", ["frozen"])
        thread = threading.Thread(target=wait_then_acquire)
        thread.start()
        blocked.set()
        # The scenario itself: hold the row three times longer than the ttl asked for.
        time.sleep(1.5)
        cursor.execute(f"SELECT {backend_for(blocker).now_sql()}", [])
        released_us = cursor.fetchone()[0]
    blocker.commit()
    blocker.close()
    thread.join(30)
    lease = outcome[0]
    assert lease is not None
    granted = Lock.objects.get(name="frozen")
    # With a transaction-start clock the expiry would be about 1 s before this instant.
    assert granted.acquired_us >= released_us
    assert granted.expires_us >= released_us + 400_000, "lease was expired at birth"
    assert (lease.expires_at - lease.acquired_at).total_seconds() == pytest.approx(0.5, abs=0.01)
    lease.release()


@pytest.mark.parametrize("isolation", ["", "repeatable read"])
def test_first_use_of_many_names_races_without_deadlocks(children, isolation):
    """8 processes first-use 40 names, in different orders, the same names at once."""
    if isolation and connections["default"].vendor != "mysql":
        pytest.skip("gap locks under REPEATABLE READ are a MariaDB/MySQL matter")
    names = [f"fresh:{i:03d}" for i in range(40)]
    env = {"DISTLOCK_TEST_ISOLATION": isolation}
    procs = [
        children.start("first_use", names[::1 if n % 2 else -1], 10.0, env=env)
        for n in range(WORKERS)
    ]
    for proc in procs:
        proc.expect("ready", timeout=60)
    for proc in procs:
        proc.send("go")
    per_name: dict[str, list[int]] = {}
    for proc in procs:
        for name, token in proc.expect("done", timeout=120)["tokens"].items():
            per_name.setdefault(name, []).append(token)
        assert proc.finish() == 0
    assert sorted(per_name) == names
    for name, tokens in per_name.items():
        assert len(set(tokens)) == WORKERS, f"{name}: a token was granted twice: {tokens}"
    assert Lock.objects.filter(name__in=names).count() == len(names)


@pytest.mark.parametrize("isolation", ["", "repeatable read"])
def test_purge_racing_first_uses_never_lowers_a_token(children, isolation):
    """Purgers delete every idle row, over and over, in batches of two, while processes
    acquire and release the same few names: each grant of a name is very often the first
    use of a purged name. Its tokens must still only go up, across every re-creation."""
    if isolation and connections["default"].vendor != "mysql":
        pytest.skip("gap locks under REPEATABLE READ are a MariaDB/MySQL matter")
    env = {"DISTLOCK_TEST_ISOLATION": isolation}
    names = [f"purged:{i}" for i in range(5)]
    cyclers = [children.start("cycle_names", names[n:] + names[:n], 120, 30.0, env=env)
               for n in range(3)]
    purgers = [children.start("purge_loop", 2, env=env) for _ in range(2)]
    for proc in cyclers + purgers:
        proc.expect("ready", timeout=60)
    for proc in cyclers + purgers:
        proc.send("go")
    grants: list[tuple[float, str, int]] = []
    for proc in cyclers:
        grants += [(at, name, token) for name, token, at in proc.expect("done", timeout=180)
                   ["grants"]]
    for proc in purgers:
        proc.send("stop")
    purged = sum(proc.expect("done", timeout=60)["purged"] for proc in purgers)
    for proc in cyclers + purgers:
        assert proc.finish() == 0
    assert purged >= len(names), f"the purgers deleted only {purged} rows: no race"
    last: dict[str, int] = {}
    for _, name, token in sorted(grants):
        assert token > last.get(name, 0), f"{name}: token {token} after {last[name]}"
        last[name] = token
    assert len(grants) == 3 * 120


QUEUED = 6


def _listening_waiters() -> int:
    """PostgreSQL sessions of this test database registered as waiting (distlock_listen's
    or distlock_queue's shared advisory lock); other test runs on the server are not counted."""
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
            "AND classid = ANY(%s::oid[]) AND mode = 'ShareLock' AND granted AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())",
            [[WAKEUP_CLASS, QUEUE_CLASS]],
        )
        return int(cursor.fetchone()[0])


def test_threads_waiting_for_one_name_take_turns(lock_db):
    """Threads of one process waiting for a name queue up: they get it in the order they
    came, and only the first of them waits on the database (on PostgreSQL: one LISTEN,
    where each thread used to listen and race at every release). A thread that comes back
    for more right after its release queues behind the others. A thread whose timeout
    ends while it queues gives up on time and the queue goes on without it."""
    holder = acquire("turns", ttl=60)
    order: list[int] = []
    outcomes: dict[int, object] = {}

    def wait(number: int, timeout: float) -> None:
        try:
            lease = acquire("turns", ttl=60, timeout=timeout)
            outcomes[number] = lease
            if lease is not None:
                order.append(number)
                lease.release()
                if number == 0:
                    # Straight back for more: behind the queue, not ahead of it.
                    again = acquire("turns", ttl=60, timeout=60)
                    assert again is not None
                    order.append(number)
                    again.release()
        finally:
            connections.close_all()

    threads = []
    for number in range(QUEUED):
        # Thread 3 gives up while it queues, behind threads that wait for a minute.
        thread = threading.Thread(target=wait, args=(number, 1.0 if number == 3 else 60.0))
        thread.start()
        threads.append(thread)
        wait_until(lambda n=number: queued("default", "turns") == n + 1, 30,
                   f"thread {number} queued")
    wait_until(lambda: 3 in outcomes, 30, "the short wait ended")
    assert outcomes[3] is None
    assert queued("default", "turns") == QUEUED - 1
    if backend_for(connections["default"]).supports_wakeups() and conf.WAKEUPS:
        wait_until(lambda: _listening_waiters() == 1, 30, "the first waiter listening")
        assert _listening_waiters() == 1, "more than the first waiter waits on the database"
    holder.release()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert order == [0, 1, 2, 4, 5, 0], "the lock was not handed over in arrival order"
    assert queued("default", "turns") == 0


def test_a_blocking_acquire_queues_behind_a_pausing_thread_even_when_the_lock_is_free(
    lock_db, settings
):
    """A blocking acquire that finds a thread of its process queued for the name does not
    try first: even when the lock is free (freed by another process, so nothing cut the
    queued thread's pause short), it waits behind that thread instead of barging past it.
    The queued thread's pause is made long (seconds) and the database's own wake-ups are
    off, so a barging try would win every time: no race decides this test."""
    settings.DISTLOCK_POLL_INTERVAL = 5.0
    settings.DISTLOCK_POLL_MAX_INTERVAL = 5.0
    settings.DISTLOCK_WAKEUPS = False
    holder = acquire("turns-free", ttl=60)
    order: list[str] = []

    def wait() -> None:
        lease = acquire("turns-free", ttl=60, timeout=60)
        assert lease is not None
        order.append("queued first")
        lease.release()

    thread = start_thread(wait)
    try:
        wait_until(lambda: queued("default", "turns-free") == 1, 30, "a thread queued")
        # Free the row as a release from another process would: this process's queue is
        # not told, so the queued thread sleeps on until its next look.
        held, _ = db.run("default", "release", holder.name, holder.owner, holder.token)
        assert held
        lease = acquire("turns-free", ttl=60, timeout=60)
        assert lease is not None
        order.append("came later")
        lease.release()
    finally:
        thread.join(60)
    assert not thread.is_alive()
    assert order == ["queued first", "came later"], "the later acquire barged past the queue"


@pytest.mark.parametrize("form", ["acquire", "lock"])
def test_timeout_zero_makes_its_one_try_while_a_thread_of_the_process_waits(
    lock_db, settings, form
):
    """``timeout=0`` is one try, like ``blocking=False``: a free lock is had at once even
    while another thread of the process waits for the name (before, a blocking call that
    found the in-process queue skipped its try and waited 0 s for its turn, so
    ``acquire`` returned None and ``lock`` raised LockTimeout). The waiting thread's
    pause is long and wake-ups are off, so it cannot take the lock first."""
    settings.DISTLOCK_POLL_INTERVAL = 30.0
    settings.DISTLOCK_POLL_MAX_INTERVAL = 30.0
    settings.DISTLOCK_WAKEUPS = False
    holder = acquire("turns-zero", ttl=60)
    got: list[object] = []
    thread = start_thread(lambda: got.append(acquire("turns-zero", ttl=60, timeout=60)))
    try:
        wait_until(lambda: queued("default", "turns-zero") == 1, 30, "a thread queued")
        # Freed as another process would free it: the waiting thread is not told.
        held, _ = db.run("default", "release", holder.name, holder.owner, holder.token)
        assert held
        if form == "acquire":
            lease = acquire("turns-zero", ttl=60, timeout=0)
            assert lease is not None and lease.token == holder.token + 1
            assert lease.release() is True
        else:
            with lock("turns-zero", ttl=60, timeout=0) as lease:
                assert lease.token == holder.token + 1
        assert queued("default", "turns-zero") == 1, "the waiting thread left the queue"
    finally:
        thread.join(60)
    assert not thread.is_alive()
    assert got and got[0] is not None
    got[0].release()


def test_an_acquire_inside_atomic_is_refused_at_once_while_threads_queue(lock_db):
    """The queue does not delay the transaction check: inside atomic() on the lock's
    database an acquire is refused at once, as its first try would be, not after its turn
    (the first try is skipped while threads of the process queue for the name)."""
    holder = acquire("turns-atomic", ttl=60)
    outcome: list[object] = []

    thread = start_thread(
        lambda: outcome.append(acquire("turns-atomic", ttl=60, timeout=60))
    )
    try:
        wait_until(lambda: queued("default", "turns-atomic") == 1, 30, "a thread queued")
        started = time.monotonic()
        with pytest.raises(TransactionNotAllowed), transaction.atomic():
            acquire("turns-atomic", ttl=60, timeout=60)
        assert time.monotonic() - started < 10, "refused only after waiting in the queue"
        assert queued("default", "turns-atomic") == 1
    finally:
        holder.release()
        thread.join(60)
    assert not thread.is_alive()
    lease = outcome[0]
    assert lease is not None
    lease.release()


def test_a_forked_child_does_not_inherit_the_queues(lock_db):
    """A process forked while threads queue for a name (a prefork pool started by a
    process that locks) gets no copy of their queue: its own acquires of the name are
    not held behind threads it does not have."""
    holder = acquire("turns-fork", ttl=60)
    thread = start_thread(lambda: acquire("turns-fork", ttl=60, timeout=60).release())
    try:
        wait_until(lambda: queued("default", "turns-fork") == 1, 30, "a thread queued")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what it sees, touch no connection, exit at once
            os.write(write, str(queued("default", "turns-fork")).encode())
            os._exit(0)
        os.close(write)
        seen = os.read(read, 100).decode()
        os.close(read)
        os.waitpid(pid, 0)
        assert seen == "0", f"the child inherited a queue of {seen} thread(s)"
        assert queued("default", "turns-fork") == 1
    finally:
        holder.release()
        thread.join(60)
    assert not thread.is_alive()
