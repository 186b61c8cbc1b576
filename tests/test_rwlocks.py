"""Read/write locks (distlock/rwlocks.py): readers share, a writer holds alone, a writer's
token is above every reader's before it, and a waiting writer keeps new readers out."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest
from django.db import transaction

from distlock import (
    NestedLock,
    Permit,
    StaleToken,
    TransactionNotAllowed,
    aacquire_read,
    aacquire_write,
    acquire_read,
    acquire_write,
    aread_lock,
    awrite_lock,
    current_lease,
    read_lock,
    write_lock,
)
from distlock.db import db_now_us
from distlock.models import Lock
from distlock.rwlocks import READERS
from distlock.testing import make_stale
from tests.stress.harness import HISTORY, drop_triggers, install_triggers, rows
from tests.support.helpers import run_async, start_thread, wait_until
from tests.support.shared_history import check_shared
from tests.testapp.models import Counter

pytestmark = pytest.mark.usefixtures("lock_db")

WORKERS = "tests.support.shared_workers:"


def held(name: str) -> list[str]:
    return sorted(
        Lock.objects.filter(name__startswith=f"{name}#").exclude(owner="")
        .values_list("name", flat=True)
    )


def test_readers_share_and_a_writer_waits_for_them_all():
    readers = [acquire_read("rw:a", ttl=30, blocking=False) for _ in range(3)]
    assert all(isinstance(reader, Permit) and reader.kind == "read" for reader in readers)
    assert len({reader.name for reader in readers}) == 3
    assert {reader.guard_name for reader in readers} == {"rw:a"}
    assert acquire_write("rw:a", ttl=30, blocking=False) is None, "a writer beside readers"
    assert acquire_write("rw:a", ttl=30, timeout=0) is None
    for reader in readers:
        assert reader.release() is True
    writer = acquire_write("rw:a", ttl=30, blocking=False)
    assert writer is not None and writer.name == "rw:a#write" and writer.kind == "write"
    assert writer.token > max(reader.token for reader in readers)
    assert acquire_read("rw:a", ttl=30, blocking=False) is None, "a reader beside a writer"
    assert acquire_write("rw:a", ttl=30, blocking=False) is None
    assert writer.release() is True
    assert held("rw:a") == []


def test_every_grant_is_above_the_names_last_token():
    """A writer's token is above the readers' before it, even when its own row's last
    token is lower (a per-row token would give the writer its row's token + 1)."""
    first = acquire_write("rw:t", ttl=30)
    assert first is not None and first.release()
    reader = acquire_read("rw:t", ttl=30)
    assert reader is not None and reader.token > first.token
    assert reader.release()
    second = acquire_write("rw:t", ttl=30)
    assert second is not None and second.token > reader.token
    assert second.release()


def test_a_stale_read_lease_is_refused_after_a_writer():
    counter = Counter.objects.create(key="rw:s", value=0)
    reader = acquire_read("counter:rw:s", ttl=30)
    assert reader is not None
    counter.value = 1
    counter.save(fence=reader)  # current: accepted
    make_stale(reader)  # paused past its ttl
    writer = acquire_write("counter:rw:s", ttl=30, blocking=False)
    assert writer is not None and writer.token > reader.token
    counter.value = 2
    counter.save(fence=writer)
    counter.value = 99
    with pytest.raises(StaleToken):
        counter.save(fence=reader)
    assert reader.release() is False
    assert writer.is_current()
    counter.refresh_from_db()
    assert (counter.value, counter.fence_token) == (2, writer.token)
    writer.release()


def test_a_waiting_writer_keeps_new_readers_out():
    first = acquire_read("rw:p", ttl=30)
    assert first is not None
    got: dict[str, Any] = {}
    thread = start_thread(lambda: got.update(writer=acquire_write("rw:p", ttl=30, timeout=60)))
    try:
        head = wait_until(
            lambda: Lock.objects.filter(name="rw:p#rw", expires_us__gt=db_now_us("default"))
            .exclude(holder="").first(),
            timeout=30, what="the writer's intent on the head row",
        )
        assert "writer" not in got
        intruder = acquire_read("rw:p", ttl=30, blocking=False)
        if intruder is not None:
            intruder.release()
        assert intruder is None, "a new reader was granted while a writer waited"
        assert head.holder
    finally:
        assert first.release() is True
        thread.join(60)
    writer = got["writer"]
    assert writer is not None and writer.token > first.token
    # Its grant ends its intent: readers come in as soon as it is done.
    assert writer.release() is True
    reader = acquire_read("rw:p", ttl=30, blocking=False)
    assert reader is not None
    reader.release()


def test_a_writer_that_will_not_wait_leaves_no_intent():
    reader = acquire_read("rw:n", ttl=30)
    assert reader is not None
    assert acquire_write("rw:n", ttl=30, blocking=False) is None
    other = acquire_read("rw:n", ttl=30, blocking=False)
    assert other is not None
    for lease in (reader, other):
        lease.release()


def test_at_most_the_reader_rows_read_at_once():
    readers = [acquire_read("rw:m", ttl=30, blocking=False) for _ in range(READERS)]
    assert all(readers)
    assert acquire_read("rw:m", ttl=30, blocking=False) is None
    for reader in readers:
        assert reader is not None
        reader.release()


def test_blocks_nesting_and_bad_input():
    with read_lock("rw:b", ttl=30, timeout=1) as lease:
        assert current_lease() is lease
        with pytest.raises(NestedLock):
            acquire_read("rw:b", ttl=30)
        with pytest.raises(NestedLock):
            acquire_write("rw:b", ttl=30)  # no upgrade: it would wait for itself
    with write_lock("rw:b", ttl=30, timeout=1), pytest.raises(NestedLock):
        acquire_read("rw:b", ttl=30)

    @write_lock("rw:b", ttl=30, timeout=1)
    def work() -> str:
        lease = current_lease()
        assert lease is not None
        return lease.name

    assert work() == "rw:b#write"
    assert held("rw:b") == []
    with pytest.raises(ValueError):
        acquire_read("x" * 250)
    with pytest.raises(TypeError):
        read_lock(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        write_lock("rw:b", ttl=0)
    with transaction.atomic(), pytest.raises(TransactionNotAllowed):
        acquire_write("rw:b", ttl=30)
    assert held("rw:b") == []


def test_async_twins():
    async def main() -> list[int]:
        async with aread_lock("rw:as", ttl=30, timeout=1) as reader:
            other = await asyncio.ensure_future(aacquire_read("rw:as", ttl=30, timeout=1))
            assert other is not None
            blocked = asyncio.ensure_future(aacquire_write("rw:as", ttl=30, blocking=False))
            assert await blocked is None
            await other.arelease()
        async with awrite_lock("rw:as", ttl=30, timeout=1) as writer:
            assert current_lease() is writer
        return [reader.token, other.token, writer.token]

    tokens = run_async(main)
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    assert held("rw:as") == []


@pytest.mark.processes
def test_readers_and_writers_in_processes_with_a_paused_reader(children):
    """Reader and writer processes cycle one name while a reader holding it is SIGSTOPped
    past its ttl: by the database's history no write lease overlaps another lease,
    tokens rise per name, and the woken reader's fenced write and release are refused."""
    name, ttl = "counter:rw:p", 1.0
    Counter.objects.create(key="rw:p", value=0)
    install_triggers()
    try:
        paused = children.start(WORKERS + "hold_rw", name, False, ttl)
        paused.expect("acquired", timeout=60)
        paused.signal(signal.SIGSTOP)
        cyclers = [
            children.start(WORKERS + "cycle_rw", name, write, ttl, 10)
            for write in (True, True, False, False, False)
        ]
        for cycler in cyclers:
            cycler.expect("ready", timeout=60)
        for cycler in cyclers:
            cycler.send("go")
        for cycler in cyclers:
            cycler.expect("done", timeout=120)
        paused.signal(signal.SIGCONT)
        paused.send("write")
        assert paused.expect("wrote", timeout=30)["refused"] is True
        paused.send("release")
        assert paused.expect("released", timeout=30)["held"] is False
        history = rows(HISTORY)
    finally:
        drop_triggers()
    report = check_shared(
        history, name, limit=READERS, members=f"{name}#read:", writer=f"{name}#write"
    )
    assert report.grants == 5 * 10 + 1, report
    assert report.ok, report.violations
    assert Counter.objects.get(key="rw:p").value == 2 * 10
