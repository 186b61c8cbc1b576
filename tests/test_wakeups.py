"""Wake-ups: a blocking acquire on PostgreSQL is woken by the release, not by its poll.

The waiter is a real process whose back-off pause is fixed at several seconds, so the
time from release to grant tells whether the notification or the poll woke it.
"""

from __future__ import annotations

import pytest
from django.db import connection

from distlock import acquire, break_lock
from distlock.db import db_now_us

pytestmark = [
    pytest.mark.usefixtures("lock_db"),
    pytest.mark.skipif(
        "connection.vendor != 'postgresql'",
        reason="LISTEN/NOTIFY wake-ups are PostgreSQL's; elsewhere waiting is polling",
    ),
]

POLL = 6.0  # the waiter's pause: 3-6 s with jitter
WAKEUP_CLASS = 1684825963
QUEUE_CLASS = 1684825969  # distlock_queue's "someone is queued" (migration 0006)


def _raw():
    """A session outside Django, to watch the waiter and play one by hand."""
    import psycopg

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**params, autocommit=True)


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
