"""Wake-ups: a blocking acquire on PostgreSQL is woken by the release, not by its poll.

The waiter is a real process whose back-off pause is fixed at several seconds, so the
time from release to grant tells whether the notification or the poll woke it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections import Counter
from itertools import pairwise
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from distlock import aacquire, acquire, break_lock
from distlock.conf import DEFAULTS
from distlock.constants import MAX_TOKEN
from distlock.db import db_now_us
from distlock.waiting import listener as async_wakeups
from tests.support.helpers import (
    after_each_dispatch,
    off_loop,
    run_async,
    sync_layer_tries,
    us,
    wait_for,
    wait_until,
)
from tests.support.helpers import raw_postgres as _raw
from tests.support.pgbouncer import ENTRY_CLASS, QUEUE_CLASS, WAKEUP_CLASS

pytestmark = [
    pytest.mark.usefixtures("lock_db"),
    pytest.mark.skipif(
        "connection.vendor != 'postgresql'",
        reason="LISTEN/NOTIFY wake-ups are PostgreSQL's; elsewhere waiting is polling",
    ),
]

POLL = 6.0  # the waiter's pause: 3-6 s with jitter
# How many of a queue's first waiters LISTEN by default (DISTLOCK_LISTENING_WAITERS);
# 1 is the chain alone.
LISTENERS = DEFAULTS["DISTLOCK_LISTENING_WAITERS"]


def _registered(raw, pid: int) -> bool:
    """Whether backend ``pid`` holds the shared advisory lock that says "someone is queued"."""
    return raw.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
        "AND mode = 'ShareLock' AND granted AND pid = %s",
        [QUEUE_CLASS, pid],
    ).fetchone()[0] == 1


@pytest.mark.processes
@pytest.mark.parametrize("wakeups", [
    pytest.param(True, id="wakeups", marks=pytest.mark.no_pooler(
        "DISTLOCK_WAKEUPS = True: the waiter's LISTEN needs a session of its own")),
    pytest.param(False, id="polling"),
])
def test_release_wakes_the_waiter_at_once(children, wakeups):
    holder = acquire("wake", ttl=60)
    waiter = children.start("wait_for", "wake", 30.0, 60.0, POLL, wakeups, True)
    pid = waiter.expect("ready", timeout=60)["backend_pid"]
    raw = _raw()
    try:
        waiter.send("go")
        pause = waiter.expect("pausing", timeout=30)
        assert pause["listening"] is wakeups
        assert pause["seconds"] >= POLL / 2
        assert _registered(raw, pid) is wakeups
        released_us = db_now_us("default")
        assert holder.release() is True
        got = waiter.expect("acquired", timeout=30)
    finally:
        raw.close()
    assert got["token"] == holder.token + 1
    gap = (got["acquired_us"] - released_us) / 1e6
    if wakeups:
        assert gap < 1.0, f"granted {gap:.3f} s after the release: the poll woke it"
    else:
        # The control: without the notification only the 3-6 s pause ends the wait.
        assert gap > 1.0, f"granted {gap:.3f} s after the release without a wake-up"
    assert waiter.finish() == 0


@pytest.mark.no_pooler("plays a waiter by hand: LISTEN and a session advisory lock")
def test_release_notifies_only_when_someone_waits():
    """No NOTIFY (and its commit-time serialization) for an uncontended release."""
    raw = _raw()
    try:
        channel = raw.execute("SELECT distlock_channel('quiet')").fetchone()[0]
        raw.execute(f'LISTEN "{channel}"')
        acquire("quiet", ttl=30).release()
        assert list(raw.notifies(timeout=0.5)) == [], "notified without a waiter"
        raw.execute("SELECT pg_advisory_lock_shared(%s, hashtext('quiet'))", [WAKEUP_CLASS])
        acquire("quiet", ttl=30).release()
        assert [n.channel for n in raw.notifies(timeout=10, stop_after=1)] == [channel]
        lease = acquire("quiet", ttl=30)
        assert break_lock("quiet") is True
        assert [n.channel for n in raw.notifies(timeout=10, stop_after=1)] == [channel]
        assert lease.release() is False
    finally:
        raw.close()


@pytest.mark.processes
def test_waiting_leaves_no_listen_or_advisory_lock_behind(children):
    holder = children.start("hold", "tidy", 2.0)
    holder.expect("acquired", timeout=60)
    timed_out = acquire("tidy", ttl=30, timeout=0.1)
    lease = acquire("tidy", ttl=30, timeout=30)  # waits for the 2 s lease to run out
    assert timed_out is None and lease is not None
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_listening_channels()")
        assert cursor.fetchone()[0] == 0
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = "
            "pg_backend_pid()"
        )
        assert cursor.fetchone()[0] == 0
    assert lease.release() is True
    holder.send("release")
    assert holder.expect("released")["held"] is False


# -- the hand-off: one waiter woken per release, in the order they queued ----------------

IN_LINE = "tests.support.handoff_workers:in_line"


def _queued(raw, name: str) -> list[int]:
    """The backend pids queued for ``name``, oldest first."""
    return [pid for (pid,) in raw.execute(
        "SELECT pid FROM distlock_waiter WHERE name = %s ORDER BY id", [name]
    )]


def _entries(raw, name: str) -> list[tuple[int, int]]:
    """(entry id, backend pid) of ``name``'s queue, oldest first."""
    return [(int(queued), int(pid)) for queued, pid in raw.execute(
        "SELECT id, pid FROM distlock_waiter WHERE name = %s ORDER BY id", [name]
    )]


def _behind(raw) -> dict[int, int]:
    """Waiting backend pid -> the entry id whose lock it waits for (not yet granted), in
    this test database only: advisory locks are per database, and other test runs on the
    server (the mutation check's parallel runs, a second suite) queue in theirs (a test
    comparing this with an exact map failed 1 run in 10 beside them)."""
    return {int(pid): int(objid) for pid, objid in raw.execute(
        "SELECT pid, objid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
        "AND objsubid = 2 AND mode = 'ShareLock' AND NOT granted AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database())", [ENTRY_CLASS]
    )}


def _chained(raw, name: str, pids: list[int], listeners: int | None = 1) -> bool:
    """Are ``pids`` (live waiters, in queue order, none gone yet) lined up as
    DISTLOCK_LISTENING_WAITERS ``listeners`` (None: the default) lines them up: the first
    ``listeners`` wait for no entry (they listen), each other one for the entry of the
    one just ahead of it (with 1: a chain behind the head)?"""
    k = LISTENERS if listeners is None else listeners
    entry = {pid: queued for queued, pid in _entries(raw, name)}
    behind = _behind(raw)
    return all(pid not in behind for pid in pids[:k]) and all(
        behind.get(pid) == entry.get(ahead) for ahead, pid in pairwise(pids[k - 1:]))


def _line_up(children, raw, name: str, count: int, grants: int,
             timeouts: dict[int, float] | None = None, lock_timeout: str = "",
             poll: float | None = None, listeners: int | None = 1) -> list:
    """``count`` in_line workers, queued for ``name`` one after another (in that order),
    lined up as :func:`_chained` says with DISTLOCK_LISTENING_WAITERS ``listeners``
    (default 1: each but the first waits behind the one ahead of it; None: the setting's
    default); worker n's timeout is ``timeouts[n]`` (default 120 s), and each session's
    own lock_timeout ``lock_timeout`` (default: the server's) and
    DISTLOCK_POLL_MAX_INTERVAL ``poll``."""
    workers = [children.start(IN_LINE, name, grants, (timeouts or {}).get(n, 120.0),
                              lock_timeout, poll, listeners) for n in range(count)]
    pids = [worker.expect("ready", timeout=60)["backend_pid"] for worker in workers]
    for number, worker in enumerate(workers):
        worker.send("go")
        wait_until(lambda n=number: _queued(raw, name) == pids[: n + 1]
                   and _chained(raw, name, pids[: n + 1], listeners), 30,
                   f"waiter {number} queued behind the others")
    return workers


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")
@pytest.mark.parametrize("listeners", [
    pytest.param(1, id="chain"),
    pytest.param(2, id="two-listen"),
    pytest.param(None, id="all-listen"),
])
def test_each_release_wakes_one_waiter_and_they_are_served_in_turn(children, listeners):
    """6 waiting processes, 3 grants each: every release notifies one of them (never all),
    the lock goes round in the order they queued, and tokens rise by one per grant; with
    only the head listening (a chain), the first two listening (and the four behind them
    in a chain), or all six (the default, 8: a queue that short has no chain)."""
    count, grants = 6, 3
    holder = acquire("line", ttl=60)
    raw = _raw()
    try:
        workers = _line_up(children, raw, "line", count, grants, listeners=listeners)
        assert holder.release() is True
        got = [(event["token"], number) for number, worker in enumerate(workers)
               for event in (worker.expect("acquired", timeout=60) for _ in range(grants))]
        done = [worker.expect("done", timeout=60) for worker in workers]
        wait_until(lambda: _queued(raw, "line") == [], 30, "the queue emptied")
    finally:
        raw.close()
    got.sort()
    assert [token for token, _ in got] == list(range(holder.token + 1,
                                                     holder.token + 1 + count * grants))
    # Woken once or twice per hand-off: at most one notification per release (the
    # holder's and the workers' own) and one waiter moving up the chain, and the grants
    # came by them, not by the waiters' polls (a wait that ran out: 0.5 s or more).
    notified = [event["notified"] for event in done]
    waits: Counter[str] = Counter()
    for event in done:
        waits.update(event["waits"])
    releases = 1 + count * grants
    assert sum(notified) <= releases, f"{notified}: more notifications than releases"
    assert sum(notified) + waits["moved up"] <= 2 * releases, f"{waits}: more than 2 per release"
    polls = waits["waited"] + waits["timed out"]
    assert polls <= count * grants // 2, f"{waits}: the grants came by polling"
    if listeners is None:
        # A queue no longer than the listeners: nobody ever waited behind another.
        assert waits["moved up"] == 0 and waits["head"] == 0, waits
    # First come, first served (a window that ran out under load may let one poller
    # ahead): while one waits, nobody else is served more than twice.
    order = [number for _, number in got]
    for position, number in enumerate(order):
        later = order[position + 1:]
        upto = later.index(number) if number in later else len(later)
        between = later[:upto]
        assert all(between.count(other) <= 2 for other in set(between)), (
            f"grant order {order}: waiter {number} was overtaken twice by one other")
    for worker in workers:
        assert worker.finish() == 0


def _reservation(raw, name: str) -> tuple[int, int]:
    row = raw.execute("SELECT reserved_pid, reserved_until_us FROM distlock_lock "
                      "WHERE name = %s", [name]).fetchone()
    return int(row[0]), int(row[1])


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiter queues on a session of its own")
def test_a_paused_waiter_holds_the_handed_lock_only_for_the_window(children):
    """The release hands the lock to a SIGSTOPped waiter: every other try is refused while
    the window is open (a blocking=False one too), and the window's end frees it."""
    holder = acquire("paused", ttl=60)
    raw = _raw()
    try:
        (waiter,) = _line_up(children, raw, "paused", 1, 1)
        pid = _queued(raw, "paused")[0]
        waiter.signal(signal.SIGSTOP)
        assert holder.release() is True
        reserved_pid, until_us = _reservation(raw, "paused")
        assert reserved_pid == pid and until_us > 0
        refused = acquire("paused", ttl=30, blocking=False)
        refused_at = db_now_us("default")
        assert refused is None and refused_at < until_us, "taken inside the window"
        lease = wait_until(lambda: acquire("paused", ttl=30, blocking=False), 30,
                           "the window ended")
        taken_at = db_now_us("default")
        assert until_us <= taken_at < until_us + 2_000_000
        assert lease.token == holder.token + 1
        waiter.signal(signal.SIGCONT)
        assert lease.release() is True
        assert waiter.expect("acquired", timeout=60)["token"] == lease.token + 1
        assert waiter.expect("done", timeout=60)["notified"] >= 1
    finally:
        raw.close()
    assert waiter.finish() == 0


@pytest.mark.no_pooler("plays a waiter by hand: LISTEN and session advisory locks")
def test_a_try_refused_in_a_hand_off_window_is_told_the_window_s_rest():
    """A release hands the lock to a queued waiter (a session playing one by hand): a try
    by anyone else inside the window is refused with nobody named as the holder (a
    hand-off, ``handed_over``) and told the rest of the window as its time left: what a
    polling waiter sleeps until, so that it tries again just as the window ends. The
    released lease's rest, long past, would have it try again at once, over and over, for
    the whole window; nothing at all would have it sleep its whole poll."""
    from distlock.backends.results import Busy
    from distlock.core.grants import Request, try_once

    holder = acquire("window-rest", ttl=60)
    raw, waiter = _raw(), _raw()
    try:
        queued = waiter.execute(
            "SELECT queued FROM distlock_enqueue('window-rest', true, 0, 1)").fetchone()[0]
        assert holder.release() is True
        reserved_pid, until_us = _reservation(raw, "window-rest")
        assert reserved_pid == waiter.info.backend_pid and until_us > 0
        # The window is 1 s: stretched to 30 s, so that the try below falls inside it
        # however loaded the machine (the try reads the window, not how it was made).
        until_us += 29_000_000
        raw.execute("UPDATE distlock_lock SET reserved_until_us = %s "
                    "WHERE name = 'window-rest'", [until_us])
        before_us = db_now_us("default")
        busy = try_once(Request("window-rest", 30, False, 0, None, ""))
        after_us = db_now_us("default")
        assert isinstance(busy, Busy) and busy.handed_over, busy
        assert busy.remaining_us is not None
        assert until_us - after_us <= busy.remaining_us <= until_us - before_us, (
            f"told {busy.remaining_us / 1e6:.3f} s left, with "
            f"{(until_us - after_us) / 1e6:.3f} s of the window left")
        waiter.execute("SELECT distlock_leave('window-rest', %s)", [queued])
        assert _reservation(raw, "window-rest") == (0, 0), "the leave kept the reservation"
    finally:
        waiter.close()
        raw.close()


# The waiters' DISTLOCK_POLL_MAX_INTERVAL: their first poll comes 30 s or more after they
# queue, so every grant in these tests is a wake-up.
POLL_OFF = 60.0


def _served_in_turn(holder, workers) -> None:
    """The holder's release hands the lock down ``workers`` in order, by hand-offs (the
    waiters' polls are POLL_OFF: no wait of theirs ran out)."""
    assert holder.release() is True
    for offset, worker in enumerate(workers, start=1):
        assert worker.expect("acquired", timeout=60)["token"] == holder.token + offset
    for worker in workers:
        done = worker.expect("done", timeout=60)
        waits = done["waits"]
        assert waits.get("waited", 0) + waits.get("timed out", 0) == 0, (
            f"{waits}: a waiter was served by its poll, not woken")
        assert done["notified"] <= 1, f"{done}: notified more than once for one grant"


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")
def test_a_killed_waiter_is_skipped_and_the_next_one_is_handed_the_lock(children):
    holder = acquire("killed", ttl=60)
    raw = _raw()
    try:
        first, second = _line_up(children, raw, "killed", 2, 1, poll=POLL_OFF)
        dead = _queued(raw, "killed")[0]
        first.kill()
        wait_until(lambda: raw.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                       [dead]).fetchone()[0] == 0, 30, "the session ended")
        # Handed the lock: notified if it was listening by then, else it saw the
        # reservation when it became the head; never left to its poll.
        _served_in_turn(holder, [second])
        assert _queued(raw, "killed") == []
    finally:
        raw.close()
    assert second.finish() == 0


# -- the chain: only the head listens, the others wait behind the one ahead ---------------

def _holds_nothing(raw, pid: int) -> bool:
    """Backend ``pid`` is in no queue: no advisory lock held or awaited, no queue row."""
    locks = raw.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                        "AND pid = %s", [pid]).fetchone()[0]
    rows = raw.execute("SELECT count(*) FROM distlock_waiter WHERE pid = %s",
                       [pid]).fetchone()[0]
    return locks == 0 and rows == 0


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")
def test_a_killed_waiter_in_the_middle_of_the_chain_strands_nobody(children):
    """SIGKILL the second of four queued waiters: the third, which waited behind it, now
    waits behind the first (the dead one's row is still there, its lock gone), and the
    lock goes round the three survivors in order, each woken, none by its poll."""
    holder = acquire("middle", ttl=60)
    raw = _raw()
    try:
        workers = _line_up(children, raw, "middle", 4, 1, poll=POLL_OFF)
        pids = _queued(raw, "middle")
        workers[1].kill()
        wait_until(lambda: raw.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                       [pids[1]]).fetchone()[0] == 0, 30, "the session ended")
        survivors = [pids[0], pids[2], pids[3]]
        wait_until(lambda: _chained(raw, "middle", survivors), 30,
                   "the third waiter waits behind the first")
        assert _queued(raw, "middle") == pids, "the dead waiter's row went early"
        _served_in_turn(holder, [workers[0], workers[2], workers[3]])
        wait_until(lambda: _queued(raw, "middle") == [], 30, "the queue emptied")
    finally:
        raw.close()
    for worker in (workers[0], workers[2], workers[3]):
        assert worker.finish() == 0


def _left_cleanly(raw, name: str, holder, workers: list, pids: list[int], report: dict,
                  within: float) -> None:
    """The middle one of three chained waiters left (``report``: its session as it left):
    its lock_timeout and client check as they were, nothing of it left in the queue, the
    third now waiting behind the first, and both served in turn."""
    assert report["lock_timeout"] == "30s"
    assert report["client_connection_check_interval"] in ("0", None)
    # Put back as it was: by RESET, not a SET of 0 (a SET stays on a pooled session).
    assert report["check_source"] in ("default", "configuration file", None), report
    assert _holds_nothing(raw, pids[1])
    wait_until(lambda: _chained(raw, name, [pids[0], pids[2]]), within,
               "the third waiter waits behind the first")
    _served_in_turn(holder, [workers[0], workers[2]])


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")
def test_a_timeout_that_ends_behind_another_waiter_is_kept_and_leaves_nothing(children):
    """The second of three queued waiters has a 2 s timeout: it returns None after 2 s
    (not after the lock_timeout of its session, 30 s, nor never), leaves no row and no
    advisory lock, finds its session's timeouts as they were (distlock sets lock_timeout
    and client_connection_check_interval while it waits), and the third now waits behind
    the first; then all goes on in order."""
    holder = acquire("patience", ttl=60)
    raw = _raw()
    try:
        workers = _line_up(children, raw, "patience", 3, 1, {1: 2.0}, "30s", POLL_OFF)
        pids = _queued(raw, "patience")
        gave_up = workers[1].expect("timeout", timeout=60)
        assert 2.0 <= gave_up["waited"] < 3.0, f"gave up after {gave_up['waited']:.3f} s"
        assert gave_up["statement_timeout"] == "0"
        assert _queued(raw, "patience") == [pids[0], pids[2]]
        _left_cleanly(raw, "patience", holder, workers, pids, gave_up, 10)
    finally:
        raw.close()
    for worker in workers:
        assert worker.finish() == 0


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")
def test_ctrl_c_behind_another_waiter_leaves_the_queue_clean(children):
    """SIGINT (KeyboardInterrupt) to a waiter blocked behind another: psycopg cancels its
    wait on the server, the acquire raises it, and on the way out the waiter leaves the
    queue: no row, no advisory lock, its lock_timeout as it was, and the one behind it
    moves up."""
    holder = acquire("interrupted", ttl=60)
    raw = _raw()
    try:
        workers = _line_up(children, raw, "interrupted", 3, 1, lock_timeout="30s", poll=POLL_OFF)
        pids = _queued(raw, "interrupted")
        workers[1].signal(signal.SIGINT)
        stopped = workers[1].expect("interrupted", timeout=60)
        _left_cleanly(raw, "interrupted", holder, workers, pids, stopped, 30)
    finally:
        raw.close()
    for worker in workers:
        assert worker.finish() == 0


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")
@pytest.mark.parametrize("listeners", [
    pytest.param(1, id="next-behind-it"),
    pytest.param(None, id="next-listening"),
])
def test_a_waiter_interrupted_with_the_hand_off_passes_it_to_the_next(children, listeners):
    """Three queued waiters: one played by hand ahead, then two processes, the first of
    them waiting behind the one ahead (a chain), the second behind it or listening (the
    default). The one ahead is handed the lock and releases it still queued, so the
    release hands the lock to the first process while it waits behind that entry. SIGINT
    (Ctrl-C) cancels its wait: it leaves without the grant, and hands its reservation on.
    The second process is handed the lock at once (notified, or woken by the leaver's
    entry and finding the lock reserved for it), not left to wait out the window and then
    its poll (POLL_OFF: 30 s or more). Both lines-up: a leave that kept the reservation
    strands either; one that only cleared it, waking nobody, strands the listening one."""
    name = f"pass-on-{listeners}"
    holder = acquire(name, ttl=60)
    raw, ahead = _raw(), _raw()
    try:
        first_entry = ahead.execute(
            "SELECT queued FROM distlock_enqueue(%s, true, 0, 1)", [name]).fetchone()[0]
        leaver = children.start(IN_LINE, name, 1, 120.0, "", POLL_OFF, 1)
        leaver_pid = leaver.expect("ready", timeout=60)["backend_pid"]
        leaver.send("go")
        wait_until(lambda: _behind(raw).get(leaver_pid) == first_entry, 30,
                   "the first process waits behind the entry ahead")
        following = children.start(IN_LINE, name, 1, 120.0, "", POLL_OFF, listeners)
        following_pid = following.expect("ready", timeout=60)["backend_pid"]
        following.send("go")
        wait_until(lambda: len(_queued(raw, name)) == 3, 30, "the second process queued")
        assert _queued(raw, name)[1:] == [leaver_pid, following_pid]
        leaver_entry = _entries(raw, name)[1][0]
        if listeners == 1:
            wait_until(lambda: _behind(raw).get(following_pid) == leaver_entry, 30,
                       "the second process waits behind the first")
        else:
            assert following_pid not in _behind(raw), "a short queue's second waiter listens"
        # The one ahead: handed the lock, granted, and released before it left the queue.
        assert holder.release() is True
        assert _reservation(raw, name)[0] == ahead.info.backend_pid
        owner = "by-hand-" + name
        status, token = ahead.execute(
            "SELECT status, token FROM distlock_acquire(%s, %s, 'ahead', 60000000, %s)",
            [name, owner, MAX_TOKEN]).fetchone()
        assert status == "granted" and token == holder.token + 1
        assert ahead.execute("SELECT held FROM distlock_release(%s, %s, %s, true)",
                             [name, owner, token]).fetchone()[0] is True
        assert _reservation(raw, name)[0] == leaver_pid, "not handed to the first process"
        assert _behind(raw).get(leaver_pid) == first_entry, "the first process moved"
        # The window is 1 s: stretched to 30 s, so that the leaver still holds the
        # reservation when its Ctrl-C arrives, however loaded the machine (a window that
        # ran out first leaves nothing to pass on, and the next waiter polls: it failed so
        # once in the mutation check's parallel runs).
        raw.execute("UPDATE distlock_lock SET reserved_until_us = reserved_until_us + "
                    "30000000 WHERE name = %s AND reserved_pid = %s", [name, leaver_pid])
        leaver.signal(signal.SIGINT)
        leaver.expect("interrupted", timeout=60)
        assert _holds_nothing(raw, leaver_pid)
        # Reserved for the next one now (0: it was granted already), not kept by the leaver.
        assert _reservation(raw, name)[0] in (following_pid, 0), "the leaver kept it"
        got = following.expect("acquired", timeout=60)
        assert got["token"] == token + 1
        waits = following.expect("done", timeout=60)["waits"]
        assert waits.get("waited", 0) + waits.get("timed out", 0) == 0, (
            f"{waits}: the next waiter got the lock by its poll, not by the hand-off")
        ahead.execute("SELECT distlock_leave(%s, %s)", [name, first_entry])
        assert _queued(raw, name) == []
    finally:
        ahead.close()
        raw.close()
    assert following.finish() == 0
    assert leaver.finish() == 0


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")
def test_a_waiter_handed_the_lock_too_late_queues_again_at_the_back(children):
    """Two queued waiters, the second behind the first; the first is SIGSTOPped as a
    release hands it the lock, its window runs out and the test takes the lock. Let go
    on, the first finds its hand-off came too late (refused) and queues again, at the
    back: behind the second, which is handed the lock first; then the first is handed it
    in its turn, by a wake-up, not by its poll (POLL_OFF: 15 s or more, the test's
    lease's rest)."""
    holder = acquire("late", ttl=60)
    raw = _raw()
    try:
        first, second = _line_up(children, raw, "late", 2, 1, poll=POLL_OFF)
        pids = _queued(raw, "late")
        first.signal(signal.SIGSTOP)
        try:
            assert holder.release() is True
            assert _reservation(raw, "late")[0] == pids[0]
            lease = wait_until(lambda: acquire("late", ttl=30, blocking=False), 30,
                               "the window ended")
        finally:
            first.signal(signal.SIGCONT)
        assert lease.token == holder.token + 1
        wait_until(lambda: _queued(raw, "late") == [pids[1], pids[0]]
                   and _chained(raw, "late", [pids[1], pids[0]]), 30,
                   "the late waiter queued again, behind the second")
        assert lease.release() is True
        assert second.expect("acquired", timeout=60)["token"] == lease.token + 1
        assert first.expect("acquired", timeout=60)["token"] == lease.token + 2
        for worker in (first, second):
            waits = worker.expect("done", timeout=60)["waits"]
            assert waits.get("waited", 0) + waits.get("timed out", 0) == 0, (
                f"{waits}: a waiter was served by its poll, not woken")
        assert _queued(raw, "late") == []
    finally:
        raw.close()
    for worker in (first, second):
        assert worker.finish() == 0


@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiter queues on a session of its own")
def test_an_interrupt_as_the_enqueue_returns_leaves_no_place_in_the_queue(monkeypatch):
    """A Ctrl-C (or a soft time limit) that lands just after distlock_enqueue committed,
    before the waiter knows its entry: nobody holds that waiter to stop it, so it ends its
    session itself. Else the session, alive in the user's shell, would keep its place:
    every release would hand the lock to it and wait out the window."""
    from distlock.waiting.queue import Waiter

    queue = Waiter._queue
    calls: list[bool] = []

    def interrupted_on_return(self: Waiter, first: bool) -> bool:
        queue(self, first)
        calls.append(first)
        raise KeyboardInterrupt

    holder = acquire("interrupted-enqueue", ttl=60)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    monkeypatch.setattr(Waiter, "_queue", interrupted_on_return)
    raw = _raw()
    try:
        with pytest.raises(KeyboardInterrupt):
            acquire("interrupted-enqueue", ttl=60, timeout=30)
        assert calls == [True]
        # A closed session's backend ends a moment after the client closed it; its row
        # stays until a release skips it (its "alive" lock is free), as a killed waiter's.
        wait_until(lambda: raw.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                                       [pid]).fetchone()[0] == 0, 10, "the session ended")
        assert raw.execute("SELECT count(*) FROM pg_locks WHERE pid = %s",
                           [pid]).fetchone()[0] == 0
    finally:
        raw.close()
    assert holder.release() is True
    # Nothing reserved the lock for the session that is gone: the next try gets it.
    again = acquire("interrupted-enqueue", ttl=5, blocking=False)
    assert again is not None and again.release() is True


# -- the seam: the first waiters listen, those further back wait in the chain -------------

@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")
@pytest.mark.parametrize("gone", ["second killed", "second timed out", "third killed"])
def test_a_waiter_past_the_listeners_moves_up_when_one_ahead_leaves(children, gone):
    """Four waiters, DISTLOCK_LISTENING_WAITERS = 2: the first two listen, the third waits
    on the second's entry and the fourth on the third's. The second leaves (SIGKILL, or
    its 4 s timeout): the third, woken, now waits on the first, the live listener ahead of
    it. Or the third is killed: the fourth now waits on the second. Either way the lock
    goes round the three left in order, each woken, none by its poll."""
    name = "seam-" + gone.replace(" ", "-")
    leaver = 2 if gone == "third killed" else 1
    survivors: list = []
    holder = acquire(name, ttl=60)
    raw = _raw()
    try:
        timeouts = {1: 4.0} if gone == "second timed out" else None
        workers = _line_up(children, raw, name, 4, 1, timeouts, poll=POLL_OFF, listeners=2)
        pids = _queued(raw, name)
        entry = {pid: queued for queued, pid in _entries(raw, name)}
        if gone == "second timed out":
            assert workers[1].expect("timeout", timeout=60)["waited"] >= 4.0
            assert _holds_nothing(raw, pids[1])
        else:
            workers[leaver].kill()
            wait_until(lambda: raw.execute("SELECT count(*) FROM pg_stat_activity WHERE "
                                           "pid = %s", [pids[leaver]]).fetchone()[0] == 0,
                       30, "the session ended")
        if leaver == 1:
            expected = {pids[2]: entry[pids[0]], pids[3]: entry[pids[2]]}
        else:
            expected = {pids[3]: entry[pids[1]]}
        wait_until(lambda: _behind(raw) == expected, 30,
                   f"waiters behind the entries {expected}")
        survivors = [worker for number, worker in enumerate(workers) if number != leaver]
        _served_in_turn(holder, survivors)
        wait_until(lambda: _queued(raw, name) == [], 30, "the queue emptied")
    finally:
        raw.close()
    for worker in survivors + ([workers[1]] if gone == "second timed out" else []):
        assert worker.finish() == 0


# -- async acquires beside queued sync waiters ----------------------------------------------
#
# Async waiters are not queued (README, "Waiting"): an async try is refused like any other
# while a hand-off's window is open. A *blocking* async acquire that waits LISTENs on the
# lock's channel, and while it does, releases reserve nothing and everybody races (so that
# it cannot be starved by a queue it is not in); a blocking=False try never listens.


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")
def test_async_tries_never_jump_the_queue_of_sync_waiters(children):
    """3 sync waiters (processes) queued behind a holder; a coroutine of this process tries
    blocking=False over and over from before the release. Every release hands the lock
    to the next queued waiter and its window refuses the coroutine, so the sync waiters
    are served in the order they queued and the coroutine only after the last of them."""
    count = 3
    holder = acquire("mixed", ttl=60)
    tried, released = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    async def poll() -> tuple[int, int]:
        refused_after_release = 0
        while (lease := await aacquire("mixed", ttl=30, blocking=False)) is None:
            if released.is_set():
                refused_after_release += 1
            tried.set()
            # The pace of the tries (not a wait for something): a few hundred a second,
            # without taking the CPU the waiters need to come for their grants.
            await asyncio.sleep(0.002)
        token = lease.token
        assert await lease.arelease() is True
        return token, refused_after_release

    def poller() -> None:
        try:
            outcome["result"] = run_async(poll, 90)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = exc

    raw = _raw()
    thread = threading.Thread(target=poller, name="async-poller", daemon=True)
    try:
        workers = _line_up(children, raw, "mixed", count, 1)
        thread.start()
        assert tried.wait(30), "the coroutine made no try"
        assert holder.release() is True
        released.set()
        tokens = [worker.expect("acquired", timeout=60)["token"] for worker in workers]
        thread.join(90)
        assert not thread.is_alive(), "the coroutine was never granted the lock"
    finally:
        released.set()
        raw.close()
    assert "error" not in outcome, outcome.get("error")
    async_token, refused = outcome["result"]
    first = holder.token + 1
    assert tokens == list(range(first, first + count)), (
        f"sync waiters' tokens {tokens}: not served in the order they queued")
    assert async_token == first + count, (
        f"the coroutine got token {async_token}, ahead of a queued waiter ({tokens})")
    assert refused >= 1, "no try of the coroutine fell between the release and its grant"
    for worker in workers:
        # Woken at least once: notified as the head, or by the waiter ahead leaving (the
        # chain's lock-manager wake-up, after which it may find its reservation unnotified).
        done = worker.expect("done", timeout=60)
        assert done["notified"] + done["waits"].get("moved up", 0) >= 1, done
        assert worker.finish() == 0


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiter queues on a session of its own")
def test_an_async_waiter_gets_a_stopped_waiters_lock_only_when_the_window_ends(children):
    """The release hands the lock to a SIGSTOPped sync waiter; a blocking async acquire
    begun inside the window is granted by the window's end (the stopped waiter never
    came), not before it, and the waiter, let go on, is handed the lock after it."""
    holder = acquire("stopped", ttl=60)
    raw = _raw()
    try:
        (waiter,) = _line_up(children, raw, "stopped", 1, 1)
        pid = _queued(raw, "stopped")[0]
        waiter.signal(signal.SIGSTOP)
        assert holder.release() is True
        reserved_pid, until_us = _reservation(raw, "stopped")
        assert reserved_pid == pid and until_us > 0

        async def wait() -> tuple[int, int, int]:
            began_us = await sync_to_async(db_now_us)("default")
            lease = await aacquire("stopped", ttl=30, timeout=30)
            assert lease is not None, "the async acquire timed out"
            return began_us, us(lease.acquired_at), lease.token

        began_us, acquired_us, token = run_async(wait)
        assert began_us < until_us, "the async acquire began after the window"
        assert acquired_us >= until_us, (
            f"granted {(until_us - acquired_us) / 1e3:.1f} ms inside the stopped waiter's "
            "window")
        assert token == holder.token + 1
        assert _reservation(raw, "stopped") == (0, 0), "the grant left a reservation"
        waiter.signal(signal.SIGCONT)
        # The coroutine's lease is still held (run_async only closed its connection).
        assert acquire("stopped", ttl=30, blocking=False) is None
        assert break_lock("stopped") is True  # frees it, as its release would
        assert waiter.expect("acquired", timeout=60)["token"] == token + 1
        assert waiter.expect("done", timeout=60)["notified"] >= 1
    finally:
        raw.close()
    assert waiter.finish() == 0



# Between a waiting coroutine's refused try and its wait for a wake-up, a release is
# announced to nobody. The two tests below release in that gap, by holding the refused
# try in Django's sync layer (sync_layer_tries); the pauses are 30-60 s, so a wake-up
# lost there shows as no grant within the tests' 10 s.
ASYNC_POLL = 60


@pytest.mark.no_pooler("the LISTEN connection of DISTLOCK_WAKEUPS = True needs a session")
def test_a_release_between_the_refused_try_and_the_listen_is_not_missed(settings):
    """The coroutine's first try is refused; the lock is released before its LISTEN has
    been sent, so the release notifies nobody. Once the LISTEN took effect the
    coroutine must look again at once: it gets the lock without any wake-up."""
    settings.DISTLOCK_WAKEUPS = True
    settings.DISTLOCK_POLL_INTERVAL = settings.DISTLOCK_POLL_MAX_INTERVAL = ASYNC_POLL
    holder = acquire("gap:listen", ttl=120)

    async def body() -> tuple[int, list[str]]:
        with sync_layer_tries(hold=1) as gate, after_each_dispatch() as dispatched:
            task = asyncio.create_task(aacquire("gap:listen", ttl=30, timeout=100))
            await wait_for(gate.holding.is_set, what="the first try refused")
            assert await off_loop(holder.release) is True
            gate.let_go()
            done, _ = await asyncio.wait({task}, timeout=10)
            assert task in done, "the release before the LISTEN was missed until a poll"
            lease = task.result()
            woken = list(dispatched)
        assert await lease.arelease() is True
        return lease.token, woken

    token, woken = run_async(body, seconds=40)
    assert token == holder.token + 1
    assert woken == [], f"the release was announced after all: {woken}"


@pytest.mark.no_pooler("the LISTEN connection of DISTLOCK_WAKEUPS = True needs a session")
def test_a_release_announced_while_every_async_waiter_tries_is_not_lost(settings):
    """The only waiting coroutine listens and is inside its try (refused, not yet waiting
    again) when the release's NOTIFY reaches the loop: there is no waiter to wake. The
    wake-up must be kept for the next one to wait, so the coroutine tries again at once
    and gets the lock, instead of sleeping through a release it was told of."""
    settings.DISTLOCK_WAKEUPS = True
    settings.DISTLOCK_POLL_INTERVAL = settings.DISTLOCK_POLL_MAX_INTERVAL = ASYNC_POLL
    holder = acquire("gap:trying", ttl=120)
    channel = async_wakeups.channel("gap:trying")

    async def body() -> int:
        # The second refused try: the one right after the LISTEN took effect.
        with sync_layer_tries(hold=2) as gate, after_each_dispatch() as dispatched:
            task = asyncio.create_task(aacquire("gap:trying", ttl=30, timeout=100))
            await wait_for(gate.holding.is_set, what="the try after the LISTEN refused")
            assert await off_loop(holder.release) is True
            await wait_for(lambda: channel in dispatched, what="the release announced")
            gate.let_go()
            done, _ = await asyncio.wait({task}, timeout=10)
            assert task in done, "the release announced during the try was lost"
            lease = task.result()
        assert await lease.arelease() is True
        return lease.token

    assert run_async(body, seconds=40) == holder.token + 1


# -- the edges (issue 27): a session's own timeouts, and a stopped waiter anywhere ---------

@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiter queues on a session of its own")
@pytest.mark.parametrize("setting", ["lock_timeout", "statement_timeout"])
def test_a_session_timeout_while_joining_the_queue_counts_as_busy_and_leaves_nothing(setting):
    """Another transaction holds the lock row (any operation in flight); the waiter's
    session has a 200 ms ``lock_timeout`` or ``statement_timeout``. Joining the queue
    reads the row FOR SHARE, which runs into it: the acquire goes on as busy and gives up
    at its own timeout, raising nothing, and the session keeps no advisory lock, no queue
    row and no LISTEN (before 0.3 it raised and kept three advisory locks)."""
    holder = acquire("edgy", ttl=60)
    raw = _raw()
    try:
        raw.execute("BEGIN")
        raw.execute("SELECT 1 FROM distlock_lock WHERE name = 'edgy' FOR UPDATE")
        with connection.cursor() as cursor:
            cursor.execute(f"SET {setting} = '200ms'")
        try:
            assert acquire("edgy", ttl=30, timeout=1.0) is None
            pid = connection.connection.info.backend_pid
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_listening_channels()")
                assert cursor.fetchone()[0] == 0
            other = _raw()
            try:
                assert _holds_nothing(other, pid)
            finally:
                other.close()
        finally:
            with connection.cursor() as cursor:
                cursor.execute(f"RESET {setting}")
        raw.execute("COMMIT")
        assert holder.release() is True
    finally:
        raw.close()


@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiter queues on a session of its own")
def test_every_step_of_the_queue_gives_its_locks_back_when_cut_short():
    """The database functions of the queue, each cut short by the session's own
    lock_timeout while another transaction holds the lock row: ``distlock_enqueue``
    returns entry 0 (a first call, and a call that queues again, which also gives up its
    previous entry), ``distlock_follow`` says "waited", ``distlock_leave`` leaves all the
    same; and after each the session holds exactly what it should."""
    holder = acquire("cut", ttl=60)
    raw = _raw()
    waiter = _raw()
    pid = waiter.info.backend_pid
    owned = ("SELECT classid::bigint, mode FROM pg_locks WHERE locktype = 'advisory' "
             "AND pid = %s AND granted ORDER BY 1, 2")
    try:
        queued = waiter.execute(
            "SELECT queued FROM distlock_enqueue('cut', true, 0, 1)").fetchone()[0]
        assert queued > 0
        assert {c for c, _ in raw.execute(owned, [pid])} == {ENTRY_CLASS, QUEUE_CLASS,
                                                              1684825975}
        # A reservation for the waiter, as a hand-off leaves it: leaving must pass it on,
        # which waits for the lock row.
        raw.execute("UPDATE distlock_lock SET reserved_pid = %s, reserved_until_us = "
                    "(extract(epoch FROM clock_timestamp()) * 1e6)::bigint + 5000000 "
                    "WHERE name = 'cut'", [pid])
        raw.execute("BEGIN")
        raw.execute("SELECT 1 FROM distlock_lock WHERE name = 'cut' FOR UPDATE")
        waiter.execute("SET lock_timeout = '100ms'")
        # Queueing again, cut short: the new entry and the previous one are both gone.
        again = waiter.execute(
            "SELECT queued, free FROM distlock_enqueue('cut', false, %s, 1)", [queued]
        ).fetchone()
        assert again == (0, False)
        assert {c for c, _ in raw.execute(owned, [pid])} == {QUEUE_CLASS, 1684825975}
        # Leaving (entry 0 now) while the row is held: it leaves all the same.
        waiter.execute("SELECT distlock_leave('cut', 0)")
        assert _holds_nothing(raw, pid)
        assert waiter.execute("SELECT count(*) FROM pg_listening_channels()").fetchone()[0] == 0
        # A first call cut short takes nothing.
        first = waiter.execute(
            "SELECT queued FROM distlock_enqueue('cut', true, 0, 1)").fetchone()[0]
        assert first == 0 and _holds_nothing(raw, pid)
        raw.execute("COMMIT")
        # distlock_follow behind a live entry, cut by the session's statement_timeout.
        ahead = _raw()
        try:
            ahead.execute("SELECT distlock_enqueue('cut', true, 0, 1)")
            waiter.execute("RESET lock_timeout")
            mine = waiter.execute(
                "SELECT queued, head FROM distlock_enqueue('cut', true, 0, 1)").fetchone()
            assert mine[0] > 0 and mine[1] is False
            waiter.execute("SET statement_timeout = '150ms'")
            status = waiter.execute(
                "SELECT status FROM distlock_follow('cut', %s, 60000)", [mine[0]]
            ).fetchone()[0]
            assert status == "waited"
            assert (ENTRY_CLASS, "ShareLock") not in set(raw.execute(owned, [pid]))
            waiter.execute("RESET statement_timeout")
            waiter.execute("SELECT distlock_leave('cut', %s)", [mine[0]])
            assert _holds_nothing(raw, pid)
        finally:
            ahead.close()
        assert holder.release() is True
    finally:
        waiter.close()
        raw.close()


def test_a_queued_waiter_pauses_at_most_poll_max_interval(settings):
    """A queued waiter's pause (Waiter.queued_pause): jittered between half of
    DISTLOCK_POLL_MAX_INTERVAL and all of it, wherever it stands in the queue; shorter only
    to wake just after the holder's expiry or at the acquire's deadline. The bound of the
    next test, checked on every pause rather than on the one that happens to matter."""
    from distlock.backends.results import Busy
    from distlock.waiting.queue import Waiter

    settings.DISTLOCK_POLL_MAX_INTERVAL = 2.0
    settings.DISTLOCK_WAKEUPS = False  # a Waiter that does not queue: only its pauses
    waiter = Waiter("default", "pauses")
    held = Busy(1, "holder", 60_000_000)
    pauses = [waiter.queued_pause(held, None) for _ in range(2000)]
    assert 1.0 <= min(pauses) < 1.1 and 1.9 < max(pauses) <= 2.0, (min(pauses), max(pauses))
    assert waiter.queued_pause(Busy(1, "holder", 300_000), None) == pytest.approx(0.301)
    assert waiter.queued_pause(held, 0.25) == 0.25
    assert waiter.queued_pause(held, -1.0) == 0.0


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")
def test_a_stopped_waiter_deep_in_the_queue_idles_the_lock_for_at_most_window_and_poll(
    children,
):
    """Six queued waiters (a chain behind the first), the fifth SIGSTOPped: the lock goes
    down the queue, is handed to the stopped one, and once its window ends the one
    behind it gets the lock within DISTLOCK_POLL_MAX_INTERVAL (2 s here), wherever it
    stands in the queue (before, a waiter behind n others polled n + 1 times as seldom:
    10-17 s idle with 20 ahead)."""
    poll = 2.0
    holder = acquire("deep", ttl=60)
    raw = _raw()
    try:
        workers = _line_up(children, raw, "deep", 6, 1, poll=poll)
        pids = _queued(raw, "deep")
        workers[4].signal(signal.SIGSTOP)
        assert holder.release() is True
        for worker in workers[:4]:
            worker.expect("acquired", timeout=60)
        reserved_pid, until_us = wait_until(
            lambda: (found := _reservation(raw, "deep"))[0] == pids[4] and found, 30,
            "the stopped waiter is handed the lock")
        got = workers[5].expect("acquired", timeout=60)
        idle = (got["acquired_us"] - until_us) / 1e6
        assert idle <= poll + 0.3, f"the lock was free and unreserved for {idle:.2f} s"
        workers[4].signal(signal.SIGCONT)
        assert workers[4].expect("acquired", timeout=60)["token"] > got["token"]
    finally:
        raw.close()
    for worker in workers:
        assert worker.finish() == 0


@pytest.mark.processes
@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiter queues on a session of its own")
@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_polling_process_beside_queued_ones_is_told_it_starves(
    children, settings, caplog, monkeypatch, api
):
    """A process with DISTLOCK_WAKEUPS = False waits beside one queued with wake-ups on:
    the release hands the lock to the queued one (here SIGSTOPped, so the reservation
    lasts its window), the poller's tries are refused, and it logs once that the setting
    must be the same in every process — from the sync API and from the async one, which
    polls through the same pause; distlock_doctor's probe sees the queued session
    from the polling process. (distlock does not make the mix fair: issue 27, item 5.)"""
    from distlock.backends.pg_pooler import mixed_wakeups_finding
    from distlock.core import grants

    monkeypatch.setattr(grants, "_warned_mixed", False)
    holder = acquire("mixed", ttl=60)
    raw = _raw()
    try:
        (waiter,) = _line_up(children, raw, "mixed", 1, 1)
        settings.DISTLOCK_WAKEUPS = False
        finding = mixed_wakeups_finding(connection)
        assert finding is not None and finding[0] == "warn" and "1 session" in finding[1]
        waiter.signal(signal.SIGSTOP)
        assert holder.release() is True
        with caplog.at_level("WARNING", logger="distlock"):
            # The window ends unclaimed, and the poller gets the lock then.
            if api == "sync":
                lease = acquire("mixed", ttl=30, timeout=30)
            else:
                lease = run_async(lambda: aacquire("mixed", ttl=30, timeout=30))
        assert lease is not None
        starving = [r for r in caplog.records if "DISTLOCK_WAKEUPS = False" in r.message]
        assert len(starving) == 1, [r.message for r in caplog.records]
        waiter.signal(signal.SIGCONT)
        assert lease.release() is True
        assert waiter.expect("acquired", timeout=60)["token"] == lease.token + 1
        settings.DISTLOCK_WAKEUPS = True
        assert mixed_wakeups_finding(connection) is None
    finally:
        raw.close()
    assert waiter.finish() == 0


@pytest.mark.no_pooler("DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")
def test_a_follow_granted_and_cancelled_at_the_same_moment_keeps_no_lock():
    """PostgreSQL can grant the entry lock a follower waits for and still raise the cancel
    (or lock_timeout) that came at the same moment. The follower's backend is stopped
    while the one ahead leaves (granting its wait) and a cancel is sent; let go on, it
    must not keep the shared lock of that entry (before, its handler knew of the lock only
    once the wait returned, and the session kept it: found by tests/test_waiting_model.py)."""
    import os

    from tests.support.helpers import start_thread

    holder = acquire("granted-cut", ttl=60)
    raw, ahead, waiter = _raw(), _raw(), _raw()
    pid = waiter.info.backend_pid
    try:
        first = ahead.execute(
            "SELECT queued FROM distlock_enqueue('granted-cut', true, 0, 1)").fetchone()[0]
        mine, head = waiter.execute(
            "SELECT queued, head FROM distlock_enqueue('granted-cut', true, 0, 1)").fetchone()
        assert head is False
        statuses: list[str] = []
        thread = start_thread(lambda: statuses.append(waiter.execute(
            "SELECT status FROM distlock_follow('granted-cut', %s, 60000)", [mine]
        ).fetchone()[0]))
        wait_until(lambda: raw.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", [pid]
        ).fetchone()[0] == 1, 30, "the follower waits for the entry ahead")
        os.kill(pid, signal.SIGSTOP)
        try:
            ahead.execute("SELECT distlock_leave('granted-cut', %s)", [first])
            assert raw.execute("SELECT pg_cancel_backend(%s)", [pid]).fetchone()[0]
        finally:
            os.kill(pid, signal.SIGCONT)
        thread.join(30)
        assert not thread.is_alive() and len(statuses) == 1
        shared = raw.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s "
            "AND classid = %s AND mode = 'ShareLock'", [pid, ENTRY_CLASS]).fetchone()[0]
        assert shared == 0, f"the follower kept the entry's shared lock ({statuses[0]})"
        waiter.execute("SELECT distlock_leave('granted-cut', %s)", [mine])
        assert _holds_nothing(raw, pid)
        assert holder.release() is True
    finally:
        for session in (waiter, ahead, raw):
            session.close()
