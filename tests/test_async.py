"""The async API (aacquire, alock, alocked, Lease.arenew/arelease, async fenced writes).

The same properties as the sync API's tests, in coroutines: exclusion between coroutines
of one process and across processes, strictly increasing tokens, stale async writes
refused after a pause past the ttl; and what only async code can do to a lock: wait
without blocking the loop, be cancelled while waiting or holding, renew in a task.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections, transaction

from distlock import (
    LockLost,
    LockTimeout,
    StaleToken,
    TransactionNotAllowed,
    aacquire,
    abreak_lock,
    acquire,
    alock,
    alocked,
    apurge_locks,
    current_lease,
    signals,
)
from distlock.models import Lock
from distlock.waiting import listener as async_wakeups
from tests.factories import AccountFactory
from tests.support.helpers import run_async, wait_expired, wait_until
from tests.testapp.models import Account

pytestmark = pytest.mark.usefixtures("lock_db")

ASYNC = "tests.support.async_workers:"


def row(name: str) -> Lock:
    return Lock.objects.get(name=name)


# -- the API, one coroutine at a time -----------------------------------------------------


def test_aacquire_gives_a_committed_lease_and_arelease_frees_it():
    async def body():
        lease = await aacquire("async:1", ttl=30)
        assert lease is not None
        assert await aacquire("async:1", ttl=30, blocking=False) is None
        assert await aacquire("async:1", ttl=30, timeout=0.05) is None
        stored = await Lock.objects.aget(name="async:1")
        assert (stored.owner, stored.token) == (lease.owner, lease.token)
        assert await lease.arelease() is True
        assert await lease.arelease() is False
        again = await aacquire("async:1", ttl=30, blocking=False)
        assert again is not None and again.token == lease.token + 1
        await again.arelease()
        return lease

    lease = run_async(body)
    assert "task=" in lease.holder
    assert row("async:1").is_free


def test_alock_block_sets_current_lease_per_task_and_raises_lock_timeout():
    seen = {}

    async def holder(name):
        async with alock(name, ttl=30) as lease:
            await asyncio.sleep(0)
            seen[name] = (current_lease() is lease, lease)

    async def body():
        await asyncio.gather(holder("a"), holder("b"))
        assert current_lease() is None
        async def contender():
            async with alock("a", ttl=30, timeout=0):
                pass

        async with alock("a", ttl=30):
            # Another task (one created inside the block too) is another holder: busy.
            with pytest.raises(LockTimeout):
                await asyncio.create_task(contender())

    run_async(body)
    assert seen["a"][0] and seen["b"][0]
    assert seen["a"][1].name == "a" and seen["b"][1].name == "b"
    assert row("a").is_free and row("b").is_free


def test_arenew_keeps_the_token_and_a_lost_lease_raises():
    async def body():
        lease = await aacquire("renewed", ttl=30)
        before = lease.expires_at
        await lease.arenew(60)
        assert lease.expires_at > before and lease.ttl == 60
        assert await abreak_lock("renewed", by="test") is True
        with pytest.raises(LockLost):
            await lease.arenew()
        assert lease.lost
        return lease

    lease = run_async(body)
    assert row("renewed").token == lease.token


def test_alocked_names_the_lock_from_the_arguments():
    names = []

    @alocked("report:{customer_id}", ttl=30)
    async def report(customer_id, *, day="today"):
        names.append(current_lease().name)
        return customer_id * 2

    assert run_async(lambda: report(21)) == 42
    assert names == ["report:21"]
    assert row("report:21").is_free


def test_apurge_locks_keeps_tokens_increasing():
    async def body():
        lease = await aacquire("purged", ttl=30)
        await lease.arelease()
        assert await apurge_locks(idle=0) >= 1
        again = await aacquire("purged", ttl=30)
        await again.arelease()
        return lease.token, again.token

    first, second = run_async(body)
    assert second > first


def test_bad_input_is_refused_before_any_sql():
    async def body():
        for bad in ("", "x" * 256, 42):
            with pytest.raises((TypeError, ValueError)):
                await aacquire(bad, ttl=30)
        with pytest.raises(ValueError):
            await aacquire("ok", ttl=0)
        with pytest.raises(TypeError):
            await aacquire("ok", ttl=30, blocking="yes")

    run_async(body)
    assert not Lock.objects.exists()
    with pytest.raises(TypeError, match=r"@alock\(...\) guards async def functions"):
        alock("x", ttl=30)(lambda: None)
    with pytest.raises(TypeError, match=r"@alocked\(...\) guards async def functions"):
        alocked("x:{a}", ttl=30)(lambda a: None)
    with pytest.raises(ValueError):
        alocked("x:{missing}", ttl=30)(_takes_a)
    with pytest.raises(ValueError):
        alock("", ttl=30)


async def _takes_a(a):
    return a


def test_alock_decorates_coroutine_functions_only_around_their_run():
    @alock("decorated", ttl=30)
    async def work():
        stored = await Lock.objects.aget(name="decorated")
        return current_lease().owner == stored.owner

    assert run_async(work) is True
    assert row("decorated").is_free


# -- the seams: the caller's transactions ---------------------------------------------------


def test_a_lock_operation_never_joins_a_transaction_left_open_by_async_code():
    """Async code can leave a transaction open only through the sync layer (autocommit
    off); the lock operations run there too, so they see it and refuse, as in sync code."""

    async def body():
        await sync_to_async(transaction.set_autocommit)(False)
        try:
            with pytest.raises(TransactionNotAllowed):
                await aacquire("in-transaction", ttl=30)
        finally:
            await sync_to_async(transaction.rollback)()
            await sync_to_async(transaction.set_autocommit)(True)

    run_async(body)
    assert not Lock.objects.filter(name="in-transaction").exists()


def test_async_to_sync_inside_atomic_is_refused_as_sync_code_is():
    """A sync view under ATOMIC_REQUESTS (or any atomic()) calling the async API through
    async_to_sync: the operation runs back in this thread, inside the transaction, and is
    refused there exactly as acquire() is."""
    from asgiref.sync import async_to_sync

    with transaction.atomic():
        with pytest.raises(TransactionNotAllowed):
            async_to_sync(aacquire)("atomic-async", ttl=30)
        with pytest.raises(TransactionNotAllowed):
            async_to_sync(abreak_lock)("atomic-async")
    assert not Lock.objects.filter(name="atomic-async").exists()


# -- fenced writes ------------------------------------------------------------------------


def test_async_fenced_writes_and_a_stale_one_refused():
    account = AccountFactory(note="start")

    async def body():
        name = f"account:{account.pk}"
        lease = await aacquire(name, ttl=0.2)
        account.note = "first"
        await account.asave(fence=lease)
        assert await Account.objects.filter(pk=account.pk).afenced_update(lease, balance=5) == 1
        other = await aacquire(f"account:{account.pk + 1000}", ttl=30)
        created = await Account.objects.afenced_create(other, pk=account.pk + 1000, note="x")
        await other.arelease()
        return lease, (created, other)

    lease, (created, other) = run_async(body)
    account.refresh_from_db()
    assert (account.note, account.balance, account.fence_token) == ("first", 5, lease.token)
    assert Account.objects.get(pk=created.pk).fence_token == other.token
    wait_expired(lease.name)
    newer = acquire(lease.name, ttl=30)
    assert newer.token > lease.token

    async def stale():
        account.note = "stale"
        with pytest.raises(StaleToken):
            await account.asave(fence=lease)
        with pytest.raises(StaleToken):
            await account.adelete(fence=lease)
        assert await account.adelete(fence=newer) == (1, {"testapp.Account": 1})

    run_async(stale)
    assert lease.lost
    assert not Account.objects.filter(pk=account.pk).exists()
    newer.release()


# -- contention between coroutines --------------------------------------------------------


def test_coroutines_in_one_process_exclude_each_other_with_increasing_tokens():
    inside = []
    tokens = []

    async def worker():
        for _ in range(5):
            async with alock("shared", ttl=30, timeout=60) as lease:
                inside.append(1)
                assert len(inside) == 1, "two coroutines inside one lock"
                tokens.append(lease.token)
                await asyncio.sleep(0.001)
                inside.pop()

    run_async(lambda: asyncio.gather(*(worker() for _ in range(8))))
    assert len(tokens) == 40
    assert tokens == sorted(tokens) and len(set(tokens)) == 40


def test_two_hundred_waiting_coroutines_need_no_thread_each():
    """200 coroutines contend for one name: all get it in turn, and the process's thread
    count stays small (waiting is asyncio, each try one short hop to the sync layer)."""
    granted = []
    threads = []

    async def worker(i):
        async with alock("crowded", ttl=30, timeout=120) as lease:
            granted.append(lease.token)
            threads.append(threading.active_count())

    run_async(lambda: asyncio.gather(*(worker(i) for i in range(200))), seconds=150)
    assert len(granted) == 200 and len(set(granted)) == 200
    assert max(threads) < 20, f"{max(threads)} threads for 200 waiting coroutines"


def test_waiting_does_not_block_the_event_loop():
    ticks = []

    async def body():
        holder = await aacquire("busy", ttl=30)
        waiting = asyncio.create_task(aacquire("busy", ttl=30, timeout=30))

        async def ticker():
            while not waiting.done():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        ticking = asyncio.create_task(ticker())
        # The waiter is waiting (not granted) while the loop keeps ticking.
        while len(ticks) < 20:
            await asyncio.sleep(0.005)
        assert not waiting.done()
        await holder.arelease()
        lease = await waiting
        await ticking
        await lease.arelease()
        return lease.token - holder.token

    assert run_async(body) == 1
    assert len(ticks) >= 20


# -- cancellation -------------------------------------------------------------------------


def test_cancelled_while_waiting_leaves_no_grant():
    async def body():
        holder = await aacquire("cancel-wait", ttl=30)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await aacquire("cancel-wait", ttl=30, timeout=30)
        stored = await Lock.objects.aget(name="cancel-wait")
        assert (stored.owner, stored.token) == (holder.owner, holder.token)
        await holder.arelease()
        return holder.token

    token = run_async(body)
    stored = row("cancel-wait")
    assert stored.is_free and stored.token == token


def test_cancelled_during_a_try_gives_its_grant_back():
    """The try is held up in the database (another transaction holds the lock row) when
    the caller is cancelled; it then gets the lock in its thread, and the grant is
    released before the cancellation reaches the caller."""
    acquire("in-flight", ttl=30).release()
    before = row("in-flight").token
    started = threading.Event()
    go_on = threading.Event()
    events = []

    def blocker():
        try:
            with transaction.atomic():
                Lock.objects.select_for_update().filter(name="in-flight").update(holder="x")
                started.set()
                go_on.wait(30)
        finally:
            connections.close_all()

    def watch(execute, sql, params, many, context):
        events.append(sql)
        return execute(sql, params, many, context)

    async def body():
        # The sync layer's own connection (``connection`` is per thread).
        await sync_to_async(lambda: connection.execute_wrappers.append(watch))()
        try:
            task = asyncio.create_task(aacquire("in-flight", ttl=30, timeout=30))
            while not events:
                await asyncio.sleep(0.005)
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done(), "the cancellation waits for the try in flight"
            go_on.set()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await sync_to_async(lambda: connection.execute_wrappers.remove(watch))()

    thread = threading.Thread(target=blocker)
    thread.start()
    try:
        assert started.wait(10)
        run_async(body)
    finally:
        go_on.set()
        thread.join(30)
    stored = row("in-flight")
    assert stored.token == before + 1, "the try in flight was expected to grant"
    assert stored.is_free, "the cancelled caller's grant was left behind"


def test_cancelled_while_holding_releases():
    async def body():
        entered = asyncio.Event()

        async def holder():
            async with alock("cancel-hold", ttl=30):
                entered.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(holder())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_async(body)
    assert row("cancel-hold").is_free


# -- auto-renew ---------------------------------------------------------------------------


def test_auto_renew_is_a_task_and_reports_loss(settings):
    settings.DISTLOCK_RENEW_FRACTION = 0.2
    renewals = []
    lost = []

    def renewed(sender, lease, **kwargs):
        renewals.append(lease.expires_at)

    async def on_lost(lease, exc):
        lost.append(exc)

    signals.lock_renewed.connect(renewed)
    try:
        async def body():
            names = {t.name for t in threading.enumerate()}
            lease = await aacquire("auto", ttl=0.5, auto_renew=True, on_lost=on_lost)
            assert not any(n.startswith("distlock-renew") for n in {
                t.name for t in threading.enumerate()} - names)
            while len(renewals) < 3:
                await asyncio.sleep(0.01)
            await abreak_lock("auto", by="test")
            while not lost:
                await asyncio.sleep(0.01)
            assert await lease.arelease() is False
            return lease

        lease = run_async(body, seconds=30)
    finally:
        signals.lock_renewed.disconnect(renewed)
    assert renewals == sorted(renewals)
    assert lease.lost and isinstance(lost[0], LockLost)


# -- PostgreSQL: a release wakes async waiters ----------------------------------------------


@pytest.mark.no_pooler("the LISTEN connection of DISTLOCK_WAKEUPS = True needs a session")
def test_a_release_wakes_async_waiters_through_one_shared_connection(settings):
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY wake-ups are PostgreSQL's")
    # Pauses far longer than the test may take: only a notification can wake them in time.
    settings.DISTLOCK_POLL_INTERVAL = 20
    settings.DISTLOCK_POLL_MAX_INTERVAL = 20

    def sessions():
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            )
            return cursor.fetchone()[0]

    before = sessions()

    def waiting_on(name):
        """How many of this loop's coroutines wait for a wake-up of ``name`` (white-box)."""
        listener = async_wakeups._listeners.get(asyncio.get_running_loop(), {}).get("default")
        state = None if listener is None else listener.channels.get(name)
        return 0 if state is None else len(state.waiting)

    async def body():
        holder = await aacquire("woken", ttl=60)
        waiters = [asyncio.create_task(aacquire("woken", ttl=60, timeout=50)) for _ in range(50)]
        # Every waiter has tried and is waiting on the shared channel. The LISTEN connection
        # alone is not enough: a release before the waiters wait lets them all in by their
        # own tries, and a release that wakes nobody would pass unseen.
        while waiting_on("woken") < 50:
            await asyncio.sleep(0.01)
        during = await sync_to_async(sessions)()
        started = time.monotonic()
        await holder.arelease()
        tokens = []
        for _ in range(50):
            done, _pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                waiters.remove(task)
                lease = task.result()
                tokens.append(lease.token)
                await lease.arelease()
        return during, time.monotonic() - started, tokens

    during, took, tokens = run_async(body, seconds=30)
    # This test's connection, the sync layer's and one LISTEN connection for 50 waiters.
    assert during <= before + 2
    # With no waiter left, the LISTEN connection is closed (and the sync layer's with the loop).
    wait_until(lambda: sessions() == before, what="the LISTEN connection closed")
    assert took < 15, f"50 grants took {took:.1f} s: the waiters were not woken"
    assert len(set(tokens)) == 50


# -- real processes ---------------------------------------------------------------------------


@pytest.mark.processes
def test_coroutines_in_several_processes_never_overlap(children):
    procs = [children.start(ASYNC + "ahammer", "ahammer", 4, 6, 10.0, 3.0) for _ in range(3)]
    for proc in procs:
        proc.expect("ready", timeout=60)
    for proc in procs:
        proc.send("go")
    grants = []
    for proc in procs:
        for _ in range(4 * 6):
            grants.append(proc.expect("grant", timeout=120))
        proc.expect("done", timeout=60)
        assert proc.finish() == 0
    grants.sort(key=lambda grant: grant["token"])
    tokens = [grant["token"] for grant in grants]
    assert tokens == list(range(tokens[0], tokens[0] + 72)), "tokens skipped or repeated"
    assert all(grant["held"] for grant in grants)
    for earlier, later in zip(grants, grants[1:], strict=False):
        end = min(earlier["released_us"], earlier["expires_us"])
        assert later["acquired_us"] >= end, f"leases overlap: {earlier} and {later}"


@pytest.mark.processes
def test_paused_async_holder_cannot_write_after_a_newer_holder_wrote(children):
    account = AccountFactory(note="initial")
    ttl = 1.0
    a = children.start(ASYNC + "awriter", "testapp.Account", account.pk, ttl)
    lease_a = a.expect("acquired", timeout=60)
    a.signal(signal.SIGSTOP)
    resume_at = time.monotonic() + 2 * ttl
    b = children.start(ASYNC + "awriter", "testapp.Account", account.pk, ttl)
    lease_b = b.expect("acquired", timeout=60)
    assert lease_b["token"] == lease_a["token"] + 1
    b.send("write", note="B")
    b.expect("wrote")
    wait_until(lambda: time.monotonic() >= resume_at, timeout=10, what="the pause")
    a.signal(signal.SIGCONT)
    a.send("write", note="A")
    refused = a.expect("refused")
    assert f"has token {lease_a['token']}" in refused["message"]
    assert refused["lost"] is True
    a.send("release")
    assert a.expect("released")["held"] is False
    account.refresh_from_db()
    assert (account.note, account.fence_token) == ("B", lease_b["token"])
    for child in (a, b):
        child.send("exit")
        assert child.finish() == 0
