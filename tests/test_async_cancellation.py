"""A cancellation that arrives while the async API is in the middle of a database operation.

The operation is made to wait in the database (another connection holds the lock row:
``SELECT … FOR UPDATE`` on PostgreSQL and MariaDB, a write transaction on SQLite) and
the caller is cancelled — by ``task.cancel()`` or by an ``asyncio.timeout`` whose
deadline passes — while it waits; the row is let go only then. Promised (issue 27, item
6): the operation still finishes (a release frees the lock, a renewal is made), and then
the cancellation goes on: CancelledError, or TimeoutError from ``asyncio.timeout``; the
code after the ``async with`` block does not run. Before the fix, ``alock``'s exit
swallowed it: the task ended normally and the code after the block ran.
"""

from __future__ import annotations

import asyncio
from importlib import import_module
from typing import Any

import pytest
from django.db import connection

from distlock import aacquire, alock
from distlock.integrations.tasks import FRAMEWORK, locked_task
from distlock.models import Lock
from distlock.waiting import listener as async_wakeups
from tests.support.helpers import (
    RowHolder,
    after_each_dispatch,
    lock_waits,
    off_loop,
    run_async,
    sync_layer_statements,
    us,
    wait_for,
    wait_until,
)

pytestmark = pytest.mark.usefixtures("lock_db")


def row(name: str) -> Lock:
    return Lock.objects.get(name=name)


async def waiting_in_database(sent: list[str], mark: int) -> None:
    """Until the operation under test has sent its statement (after the first ``mark``
    ones) and, where the server shows it, waits there for the held row."""
    await wait_for(lambda: len(sent) > mark, what="the operation's statement sent")
    if connection.vendor != "sqlite":
        try:
            await off_loop(lambda: wait_until(lambda: lock_waits() >= 1, what="a row lock wait"))
        except AssertionError as exc:
            raise AssertionError(f"{exc}; sent after the mark: {sent[mark:]}; "
                                 f"sessions: {await off_loop(sessions)}") from None


def sessions() -> list[Any]:
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute("SELECT p.id, p.command, p.state, p.info, t.trx_state "
                           "FROM information_schema.processlist p LEFT JOIN "
                           "information_schema.innodb_trx t ON p.id = t.trx_mysql_thread_id "
                           "WHERE p.db = DATABASE()")
        else:
            cursor.execute("SELECT pid, state, wait_event_type, query FROM pg_stat_activity "
                           "WHERE datname = current_database()")
        return cursor.fetchall()


async def pass_turns(count: int = 10) -> None:
    """Let the loop run ``count`` rounds: a cancellation is delivered in the first."""
    for _ in range(count):
        await asyncio.sleep(0)


def test_a_cancel_during_the_alock_release_lets_it_finish_then_goes_on():
    name = "cancel:in-release"
    leases: list[Any] = []
    after_block: list[bool] = []

    async def body():
        async with sync_layer_statements() as sent:
            may_end = asyncio.Event()
            marks: list[int] = []

            async def holder():
                async with alock(name, ttl=30) as lease:
                    leases.append(lease)
                    await may_end.wait()
                    marks.append(len(sent))
                after_block.append(True)

            task = asyncio.create_task(holder())
            await wait_for(lambda: leases, what="the block entered")
            with RowHolder(name) as blocker:
                may_end.set()
                await wait_for(lambda: marks, what="the block ended")
                await waiting_in_database(sent, marks[0])
                task.cancel()
                await pass_turns()
                assert not task.done(), "the release is shielded: it waits for the row"
                blocker.let_go()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # Freed when the cancellation arrived, not later.
                stored = await off_loop(lambda: row(name))
            return stored

    stored = run_async(body)
    assert after_block == [], "the code after the async with block ran: cancellation lost"
    lease = leases[0]
    assert stored.is_free and stored.token == lease.token
    assert lease.released_at is not None, "the release found the lease held and freed it"


def test_an_asyncio_timeout_expiring_during_the_alock_release_raises_timeout_error():
    name = "cancel:timeout-in-release"
    leases: list[Any] = []
    deadlines: list[asyncio.Timeout] = []
    after_block: list[bool] = []
    cancelling: list[int] = []

    async def body():
        async with sync_layer_statements() as sent:
            may_end = asyncio.Event()
            marks: list[int] = []

            async def holder():
                try:
                    async with asyncio.timeout(None) as deadline:
                        deadlines.append(deadline)
                        async with alock(name, ttl=30) as lease:
                            leases.append(lease)
                            await may_end.wait()
                            marks.append(len(sent))
                        after_block.append(True)
                except TimeoutError:
                    # Converted by asyncio.timeout, which found its own cancellation the
                    # only one outstanding: nothing was swallowed or left counted.
                    cancelling.append(asyncio.current_task().cancelling())
                    raise

            task = asyncio.create_task(holder())
            await wait_for(lambda: leases, what="the block entered")
            with RowHolder(name) as blocker:
                may_end.set()
                await wait_for(lambda: marks, what="the block ended")
                await waiting_in_database(sent, marks[0])
                # The deadline passes now, while the release waits.
                deadlines[0].reschedule(asyncio.get_running_loop().time())
                await wait_for(deadlines[0].expired, what="the deadline passed")
                await pass_turns()
                assert not task.done(), "the release is shielded: it waits for the row"
                blocker.let_go()
                with pytest.raises(TimeoutError):
                    await task
                stored = await off_loop(lambda: row(name))
            return stored

    stored = run_async(body)
    assert after_block == [], "the code after the async with block ran: timeout lost"
    assert cancelling == [0]
    assert stored.is_free and stored.token == leases[0].token


def test_a_cancelled_arelease_finishes_before_the_cancellation_goes_on():
    name = "cancel:arelease"

    async def body():
        async with sync_layer_statements() as sent:
            lease = await aacquire(name, ttl=30)
            with RowHolder(name) as blocker:
                mark = len(sent)
                task = asyncio.create_task(lease.arelease())
                await waiting_in_database(sent, mark)
                task.cancel()
                await pass_turns()
                assert not task.done(), "arelease is shielded: it waits for the row"
                blocker.let_go()
                with pytest.raises(asyncio.CancelledError):
                    await task
                stored = await off_loop(lambda: row(name))
            return lease, stored

    lease, stored = run_async(body)
    assert stored.is_free and stored.token == lease.token
    assert lease.released_at is not None


def test_a_cancelled_arenew_finishes_before_the_cancellation_goes_on():
    name = "cancel:arenew"

    async def body():
        async with sync_layer_statements() as sent:
            lease = await aacquire(name, ttl=30)
            before = lease.expires_at
            with RowHolder(name) as blocker:
                mark = len(sent)
                task = asyncio.create_task(lease.arenew(ttl=60))
                await waiting_in_database(sent, mark)
                task.cancel()
                await pass_turns()
                assert not task.done(), "arenew is shielded: it waits for the row"
                blocker.let_go()
                with pytest.raises(asyncio.CancelledError):
                    await task
                stored = await off_loop(lambda: row(name))
            assert await lease.arelease() is True
            return lease, before, stored

    lease, before, stored = run_async(body)
    # The renewal was made (60 s now), and the lease knows it.
    assert lease.ttl == 60 and lease.expires_at > before
    assert (stored.owner, stored.token) == (lease.owner, lease.token)
    assert stored.expires_us == us(lease.expires_at)


@pytest.mark.no_pooler("the LISTEN connection of DISTLOCK_WAKEUPS = True needs a session")
def test_a_waiter_woken_as_it_is_cancelled_stops_waiting(settings):
    """A release's wake-up and the cancellation reach a waiting coroutine in the same loop
    round: Python 3.11's asyncio.wait_for returned the wake-up and dropped the
    cancellation, and the waiter went on trying."""
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY wake-ups are PostgreSQL's")
    settings.DISTLOCK_WAKEUPS = True
    name = "cancel:woken"

    async def body():
        holder = await aacquire(name, ttl=30)
        loop = asyncio.get_running_loop()
        task = asyncio.create_task(aacquire(name, ttl=30, timeout=30))

        def waiting() -> Any:
            listener = async_wakeups._listeners.get(loop, {}).get("default")
            state = None if listener is None else listener.channels.get(name)
            return listener if state is not None and state.waiting else None

        await wait_for(waiting, what="the waiter waits for a wake-up")
        listener = waiting()
        # The same round: no await between the wake-up and the cancellation.
        listener.dispatch(async_wakeups.channel(name))
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=10)
        assert task in done and task.cancelled(), "the cancellation was swallowed"
        stored = await Lock.objects.aget(name=name)
        assert (stored.owner, stored.token) == (holder.owner, holder.token)
        assert await holder.arelease() is True

    run_async(body)



@pytest.mark.no_pooler("the LISTEN connection of DISTLOCK_WAKEUPS = True needs a session")
def test_a_waiter_woken_as_it_is_cancelled_passes_the_wake_up_on(settings):
    """Two coroutines wait for a lock; its release NOTIFYs once, and the loop's listener
    wakes one of them, the one waiting longest, which is cancelled in the same loop round
    (a task.cancel() or an asyncio.timeout deadline meeting the wake-up). Nobody else
    will announce the free lock, so the cancelled waiter must hand its wake-up to the
    other one, which gets the lock at once: the pauses here are 30-60 s, and the test
    waits 10 s."""
    if connection.vendor != "postgresql":
        pytest.skip("LISTEN/NOTIFY wake-ups are PostgreSQL's")
    settings.DISTLOCK_WAKEUPS = True
    settings.DISTLOCK_POLL_INTERVAL = 60
    settings.DISTLOCK_POLL_MAX_INTERVAL = 60
    name = "cancel:woken-passes-on"

    async def body():
        loop = asyncio.get_running_loop()

        def waiting() -> int:
            listener = async_wakeups._listeners.get(loop, {}).get("default")
            state = None if listener is None else listener.channels.get(name)
            return 0 if state is None else len(state.waiting)

        holder = await aacquire(name, ttl=120)
        first = asyncio.create_task(aacquire(name, ttl=30, timeout=100))
        await wait_for(lambda: waiting() == 1, what="the first waiter waits for a wake-up")
        second = asyncio.create_task(aacquire(name, ttl=30, timeout=100))
        await wait_for(lambda: waiting() == 2, what="the second waiter waits for a wake-up")
        woken_with: list[int] = []

        def cancel_the_woken(name_channel: str) -> None:
            if not woken_with:
                # The longest-waiting one was woken: the second still waits.
                woken_with.append(waiting())
                first.cancel()

        with after_each_dispatch(cancel_the_woken) as dispatched:
            assert await holder.arelease() is True
            done, _ = await asyncio.wait({second}, timeout=10)
        assert woken_with == [1], f"not one waiter woken by the release: {woken_with}"
        assert first.done() and first.cancelled()
        assert second in done, (
            f"the wake-up was lost with the cancelled waiter (dispatched: {dispatched})")
        lease = second.result()
        assert lease.token == holder.token + 1
        assert await lease.arelease() is True

    run_async(body, seconds=40)


# -- Django's Tasks framework: an async task function runs under alock ----------------------

django_task = import_module(FRAMEWORK).task

# What the task below and its test share: the test's events, made in its loop.
_shared: dict[str, Any] = {}


@django_task()
@locked_task("cancel:task:{key}", ttl=30, on_contention="raise")
async def held_until_told(key: str, *, lease: Any) -> int:
    _shared["leases"].append(lease)
    await _shared["may_end"].wait()
    _shared["marks"].append(len(_shared["sent"]))
    return int(lease.token)


def test_a_locked_async_task_cancelled_during_its_release_ends_cancelled():
    name = "cancel:task:1"
    returned: list[int] = []

    async def body():
        async with sync_layer_statements() as sent:
            _shared.update(sent=sent, leases=[], marks=[], may_end=asyncio.Event())

            async def run():
                returned.append(await held_until_told.func("1"))

            job = asyncio.create_task(run())
            await wait_for(lambda: _shared["leases"], what="the task body ran")
            with RowHolder(name) as blocker:
                _shared["may_end"].set()
                await wait_for(lambda: _shared["marks"], what="the body returned")
                await waiting_in_database(sent, _shared["marks"][0])
                job.cancel()
                await pass_turns()
                assert not job.done(), "the release is shielded: it waits for the row"
                blocker.let_go()
                with pytest.raises(asyncio.CancelledError):
                    await job
                stored = await off_loop(lambda: row(name))
            return stored

    try:
        stored = run_async(body)
    finally:
        lease = _shared["leases"][0] if _shared.get("leases") else None
        _shared.clear()
    assert returned == [], "the task returned normally: the cancellation was lost"
    assert lease is not None and stored.is_free and stored.token == lease.token
