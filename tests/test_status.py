"""Lock state for people and code: distlock.core.status's words for durations (the one
place seconds become "59 min"), and lock_status() / Lease.is_current()
(distlock.core.inspection) on the configured backend, judged by the database clock."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
from asgiref.sync import async_to_sync
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from distlock import Lease, LockStatus, acquire, alock_status, break_lock, lock_status
from distlock.constants import MAX_NAME_LENGTH
from distlock.core.status import EXPIRED, FREE, HELD, duration, relative
from distlock.db import db_now_us
from distlock.models import Lock
from tests.support.helpers import (
    RowHolder,
    expired_lock,
    run_async,
    run_with_deadline,
    start_thread,
    us,
    wait_until,
)
from tests.testapp.models import Account


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (0, "0 s"), (0.4, "0 s"), (12, "12 s"), (59.4, "59 s"), (59.6, "1 min"),
        (60, "1 min"), (3562, "59 min"), (3599.9, "59 min"), (3600, "1 h"),
        (3661, "1 h 1 min"), (7200, "2 h"), (86399, "23 h 59 min"), (86400, "1 day"),
        (90000, "1 day 1 h"), (2 * 86400 + 7 * 3600 + 59, "2 days 7 h"), (-12, "12 s"),
    ],
)
def test_duration_in_words(seconds, words):
    assert duration(seconds) == words


@pytest.mark.parametrize(
    ("at_s", "words"),
    [(3562, "in 59 min"), (-12, "12 s ago"), (0.2, "now"), (-0.4, "now"), (-86400, "1 day ago")],
)
def test_relative_in_words(at_s, words):
    assert relative(round(at_s * 1e6) + 10**15, 10**15) == words


def test_relative_of_an_unknown_time_is_empty():
    assert relative(None, 5) == relative(5, None) == ""


# -- lock_status() and Lease.is_current() (distlock.core.inspection) ---------------------


def _waiters_known() -> bool:
    return connection.vendor == "postgresql"


@pytest.mark.usefixtures("lock_db")
def test_a_name_never_locked_is_free_with_token_zero_and_gets_no_row():
    before = db_now_us("default")
    status = lock_status("never:locked")
    assert status == LockStatus(
        name="never:locked", held=False, state=FREE, holder=None, owner=None, token=0,
        acquired_at=None, expires_at=None, remaining=0.0, renewals=None,
        waiters=0 if _waiters_known() else None, db_now=status.db_now,
    )
    assert us(status.db_now) >= before
    assert not Lock.objects.filter(name="never:locked").exists()


@pytest.mark.usefixtures("lock_db")
def test_a_held_lock_shows_its_grant_by_the_database_clock():
    lease = acquire("st:held", ttl=30, holder="worker-A")
    lease.renew(ttl=30)
    status = lock_status("st:held")
    row = Lock.objects.get(name="st:held")
    assert (status.held, status.state) == (True, HELD)
    assert (status.owner, status.holder, status.token) == (lease.owner, lease.holder, lease.token)
    assert status.holder == row.holder and status.holder.endswith("worker-A")
    assert status.acquired_at == lease.acquired_at == row.acquired_at
    assert status.expires_at == lease.expires_at == row.expires_at
    assert status.renewals == 1
    assert status.waiters == (0 if _waiters_known() else None)
    # remaining is the lease's end less the clock the same statement read.
    assert status.db_now < status.expires_at
    assert status.remaining == pytest.approx((status.expires_at - status.db_now).total_seconds())
    assert 25 < status.remaining <= 30
    with pytest.raises(dataclasses.FrozenInstanceError):
        status.held = False


@pytest.mark.usefixtures("lock_db")
def test_the_host_clock_plays_no_part(monkeypatch):
    acquire("st:host-clock", ttl=30)
    # A host clock a day ahead (or behind) would call the lease expired (or far from it).
    for shift in (86400, -86400):
        monkeypatch.setattr(time, "time", lambda shift=shift: time.monotonic() + 1.7e9 + shift)
        status = lock_status("st:host-clock")
        assert status.held and 25 < status.remaining <= 30


@pytest.mark.usefixtures("lock_db")
def test_held_turns_expired_at_the_lease_end_by_the_database_clock():
    lease = acquire("st:runs-out", ttl=1)
    first = lock_status("st:runs-out")
    assert first.state == HELD and first.db_now < lease.expires_at
    expired = wait_until(
        lambda: (s := lock_status("st:runs-out")).state == EXPIRED and s, 10,
        "the lease's end by the database clock",
    )
    assert expired.held is False and expired.remaining == 0.0
    assert expired.db_now >= lease.expires_at  # judged at the database instant it reports
    # Expired, not taken over: the grant is still shown, for people to see who ran out.
    assert (expired.owner, expired.token, expired.expires_at) == (
        lease.owner, lease.token, lease.expires_at)
    assert lease.is_current() is False


@pytest.mark.usefixtures("lock_db")
def test_a_released_lock_is_free_and_keeps_its_token():
    lease = acquire("st:free", ttl=30)
    assert lease.release() is True
    status = lock_status("st:free")
    assert (status.held, status.state, status.token) == (False, FREE, lease.token)
    assert (status.owner, status.holder, status.acquired_at, status.expires_at) == (
        None, None, None, None)
    assert (status.remaining, status.renewals) == (0.0, None)


def test_status_agrees_with_the_admin_changelist(admin_client, three_locks):
    response = admin_client.get(reverse("admin:distlock_lock_changelist"))
    shown = response.context["cl"].result_list
    assert {obj.pk: obj.state for obj in shown} == {
        "job:held": HELD, "job:expired": EXPIRED, "job:free": FREE}
    for obj in shown:
        status = lock_status(obj.pk)
        assert (status.state, status.held) == (obj.state, obj.state == HELD)
        assert status.token == obj.token
        if obj.state == FREE:
            assert status.owner is None and obj.owner == ""
        else:
            assert (status.owner, status.holder) == (obj.owner, obj.holder)
            assert (status.acquired_at, status.expires_at) == (obj.acquired_at, obj.expires_at)
            assert status.renewals == obj.renew_count
        # Both read the database clock; the status came after the page.
        assert us(status.db_now) >= obj.db_now_us
    held, expired, _ = three_locks
    assert lock_status("job:held").renewals == 1
    assert held.is_current() and not expired.is_current()


@pytest.mark.parametrize("name", [None, "", "x" * (MAX_NAME_LENGTH + 1), 42, "a\x00b"])
@pytest.mark.usefixtures("lock_db")
def test_bad_names_are_refused_like_acquire_before_any_sql(name):
    with pytest.raises((TypeError, ValueError)) as by_acquire:
        acquire(name, ttl=30)
    with CaptureQueriesContext(connection) as queries:
        with pytest.raises(type(by_acquire.value), match=re.escape(str(by_acquire.value))):
            lock_status(name)
        with pytest.raises(type(by_acquire.value)):
            run_async(lambda: alock_status(name))
    assert len(queries) == 0
    assert not Lock.objects.exists()


@pytest.mark.usefixtures("lock_db")
def test_a_bad_alias_is_refused():
    with pytest.raises(ValueError, match="not a database alias"):
        lock_status("x", using="nowhere")
    with pytest.raises(TypeError):
        lock_status("x", using=3)


@pytest.mark.usefixtures("lock_db")
def test_inside_the_callers_atomic_nothing_is_committed_or_rolled_back():
    lease = acquire("st:atomic", ttl=30)
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        Account.objects.create(note="rolled back")
        assert lock_status("st:atomic").held and lease.is_current()
        assert lock_status("st:no-row").state == FREE
        assert connection.in_atomic_block and not connection.needs_rollback
        1 / 0  # noqa: B018 - the caller rolls back
    assert not Account.objects.filter(note="rolled back").exists()  # nothing committed
    with transaction.atomic():
        Account.objects.create(note="kept")
        assert lock_status("st:atomic").token == lease.token and lease.is_current()
        assert lock_status("st:no-row").token == 0
    assert Account.objects.filter(note="kept").exists()  # nothing rolled back
    assert lease.release() is True


@pytest.mark.usefixtures("lock_db")
def test_nested_like_atomic_requests_a_view_savepoint_and_its_rollback():
    lease = acquire("st:request", ttl=30)
    with transaction.atomic():  # ATOMIC_REQUESTS: the request's transaction
        Account.objects.create(note="request")
        with transaction.atomic():  # a view's own atomic(): a savepoint
            Account.objects.create(note="view")
            assert lock_status("st:request").owner == lease.owner
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            Account.objects.create(note="savepoint rolled back")
            assert lease.is_current()
            1 / 0  # noqa: B018
        assert lock_status("st:request").held and not connection.needs_rollback
    assert set(Account.objects.values_list("note", flat=True)) == {"request", "view"}
    assert lease.release() is True


@pytest.mark.django_db(transaction=True, databases=["default", "locks"])
def test_inside_atomic_on_another_alias_of_the_lock_database(settings):
    settings.DISTLOCK_DATABASE = "locks"
    lease = acquire("st:alias", ttl=30)
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        Account.objects.create(note="rolled back")
        status = lock_status("st:alias")
        assert status.held and status.token == lease.token and lease.is_current()
        1 / 0  # noqa: B018
    assert not Account.objects.filter(note="rolled back").exists()
    assert lease.release() is True
    assert lock_status("st:alias").state == FREE
    connections["locks"].close()


@pytest.mark.usefixtures("lock_db")
def test_status_and_is_current_never_wait_for_a_row_lock():
    lease = acquire("st:row-held", ttl=30)
    # Another transaction holds the lock row (a fenced write's check, an acquire in flight).
    with RowHolder("st:row-held"):
        status = run_with_deadline(lambda: lock_status("st:row-held"), 10)
        assert status.held and status.token == lease.token
        assert run_with_deadline(lease.is_current, 10) is True


@pytest.mark.skipif("connection.vendor == 'sqlite'",
                    reason="SQLite's atomic() here is BEGIN IMMEDIATE: it holds the file's "
                    "write lock whatever distlock reads")
@pytest.mark.usefixtures("lock_db")
def test_status_inside_atomic_leaves_no_row_lock_behind():
    lease = acquire("st:no-lock", ttl=30)
    with transaction.atomic():
        assert lock_status("st:no-lock").held and lease.is_current()
        # A FOR UPDATE/SHARE read would keep the row locked until this transaction ends,
        # and the release in another session would wait for it.
        assert run_with_deadline(lease.release, 10) is True
        assert run_with_deadline(lambda: acquire("st:no-lock", ttl=30).token, 10) == (
            lease.token + 1)


@pytest.mark.usefixtures("lock_db")
def test_is_current_follows_owner_and_token():
    lease = acquire("st:current", ttl=30)
    assert lease.is_current() is True
    lease.release()
    assert lease.is_current() is False
    again = acquire("st:current", ttl=30)
    # The same owner with another token is not this grant (a token names one grant).
    older = Lease("st:current", again.owner, again.token - 1, using="default", ttl=30)
    newer = Lease("st:current", again.owner, again.token + 1, using="default", ttl=30)
    assert again.is_current() and not older.is_current() and not newer.is_current()
    other = Lease("st:current", lease.owner, again.token, using="default", ttl=30)
    assert other.is_current() is False
    assert break_lock("st:current") is True
    assert again.is_current() is False
    assert not again.lost  # a read changes nothing


@pytest.mark.usefixtures("lock_db")
def test_is_current_turns_false_after_expiry_and_a_take_over():
    old = expired_lock("st:taken")
    assert old.is_current() is False  # expired by the database clock, not yet taken over
    assert lock_status("st:taken").owner == old.owner
    new = acquire("st:taken", ttl=30, blocking=False)
    assert new is not None and new.token == old.token + 1
    assert new.is_current() is True and old.is_current() is False
    status = lock_status("st:taken")
    assert (status.owner, status.token, status.held) == (new.owner, new.token, True)


@pytest.mark.usefixtures("lock_db")
def test_async_twins_give_the_sync_answers():
    lease = acquire("st:async", ttl=30)

    async def ask() -> tuple[LockStatus, bool, LockStatus]:
        return (await alock_status("st:async"), await lease.ais_current(),
                await alock_status("st:async:none"))

    status, current, none = run_async(ask)
    assert (status.state, status.owner, status.token) == (HELD, lease.owner, lease.token)
    assert current is True and none.state == FREE and none.token == 0
    assert lease.release() is True
    status, current, _ = run_async(ask)
    assert status.state == FREE and current is False


@pytest.mark.usefixtures("lock_db")
def test_alock_status_reads_on_the_callers_connection_inside_its_transaction():
    """Called from sync code inside atomic() (as an async view under a sync request is),
    alock_status runs where Django runs the async ORM: on the caller's thread, so its
    connection and transaction; it sees that transaction's own uncommitted write."""
    lease = acquire("st:thread", ttl=30)
    try:
        with transaction.atomic():
            Lock.objects.filter(name="st:thread").update(holder="this transaction's")
            status = async_to_sync(alock_status)("st:thread")
            assert status.holder == "this transaction's", "read on another connection"
            transaction.set_rollback(True)
        assert lock_status("st:thread").holder == lease.holder
    finally:
        assert lease.release() is True


@pytest.mark.usefixtures("lock_db")
def test_waiters_are_unknown_where_waiters_register_nowhere(settings):
    acquire("st:waiters-unknown", ttl=30)
    if _waiters_known():
        assert lock_status("st:waiters-unknown").waiters == 0
        settings.DISTLOCK_WAKEUPS = False  # waiters then poll: PostgreSQL cannot see them
    assert lock_status("st:waiters-unknown").waiters is None


@pytest.mark.no_pooler("a waiter's session advisory lock")
@pytest.mark.skipif("connection.vendor != 'postgresql'",
                    reason="waiters register (pg_locks) on PostgreSQL only")
@pytest.mark.usefixtures("lock_db")
def test_waiters_counts_a_blocked_acquire_on_postgresql():
    holder = acquire("st:wanted", ttl=60)
    granted: list[Lease] = []
    waiter = start_thread(lambda: granted.append(acquire("st:wanted", ttl=30, timeout=30)))
    try:
        wait_until(lambda: lock_status("st:wanted").waiters == 1, 10, "the waiter registers")
        assert lock_status("st:other").waiters == 0
    finally:
        holder.release()
        waiter.join(30)
    assert granted and granted[0].token == holder.token + 1
    assert lock_status("st:wanted").owner == granted[0].owner
    granted[0].release()
    wait_until(lambda: lock_status("st:wanted").waiters == 0, 10, "the waiter leaves")
