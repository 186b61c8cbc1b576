"""The audit history (LockEvent) and the signals it is recorded from."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from django.db import connection, connections, transaction

from distlock import LockLost, StaleToken, acquire, break_lock, signals
from distlock.db import db_now_us
from distlock.models import Lock, LockEvent
from distlock.ops.audit import (
    check_audit_settings,
    event_batches,
    fit,
    purge_events,
    record,
)
from distlock.testing import make_stale, take_over
from tests.support.helpers import wait_expired
from tests.testapp.models import Account, HighWaterAccount

pytestmark = pytest.mark.usefixtures("lock_db")


@pytest.fixture
def audit(settings):
    settings.DISTLOCK_AUDIT = True


def kinds(name: str) -> list[str]:
    return list(LockEvent.objects.filter(name=name).order_by("id").values_list("kind", flat=True))


def test_audit_receivers_are_connected_only_while_audit_is_on(settings):
    """With audit off, acquire's and release's signals have no audit receiver to call."""

    def audit_receivers() -> set[str]:
        found = set()
        for signal in (signals.lock_acquired, signals.lock_released, signals.lock_lost):
            found |= {key[0] for key, *_ in signal.receivers if str(key[0]).startswith(
                "distlock.ops.audit.")}
        return found

    settings.DISTLOCK_AUDIT = False
    assert audit_receivers() == set()
    settings.DISTLOCK_AUDIT = True
    assert audit_receivers() == {
        "distlock.ops.audit.acquired", "distlock.ops.audit.released", "distlock.ops.audit.lost"
    }
    acquire("follow", ttl=30).release()
    assert kinds("follow") == ["acquired", "released"]
    settings.DISTLOCK_AUDIT = False
    assert audit_receivers() == set()


def test_nothing_is_recorded_when_audit_is_off():
    assert LockEvent._meta.db_table == "distlock_lockevent"
    lease = acquire("quiet", ttl=30)
    lease.renew()
    lease.release()
    assert not LockEvent.objects.exists()
    assert record("acquired", name="quiet", using="default") is False


def test_grant_renew_release_are_recorded_with_the_database_clock(audit):
    before = db_now_us("default")
    lease = acquire("life", ttl=30, holder="worker-7")
    lease.renew(ttl=60)
    assert lease.release() is True
    after = db_now_us("default")
    events = list(LockEvent.objects.filter(name="life").order_by("id"))
    assert [e.kind for e in events] == ["acquired", "renewed", "released"]
    for event in events:
        assert (event.token, event.owner) == (lease.token, lease.owner)
        assert event.holder.endswith("worker-7")
        assert before <= event.at_us <= after
    assert events[0].at_us <= events[1].at_us <= events[2].at_us
    assert events[0].at == lease.acquired_at or events[0].at >= lease.acquired_at
    assert lease.expires_at.isoformat() in events[1].detail
    assert events[2].detail == ""


def test_expired_take_over_names_the_previous_holder(audit):
    old = acquire("slow", ttl=0.05, holder="sleeper")
    wait_expired("slow")
    new = acquire("slow", ttl=30, holder="fresh")
    assert old.release() is False
    assert kinds("slow") == ["acquired", "took_over"]
    event = LockEvent.objects.get(name="slow", kind="took_over")
    assert event.token == new.token == old.token + 1
    assert "sleeper" in event.detail and event.holder.endswith("fresh")
    assert event.get_kind_display() == "expired take-over"


def test_release_of_an_expired_lease_says_so(audit):
    lease = acquire("late", ttl=0.05)
    wait_expired("late")
    assert lease.release() is False
    event = LockEvent.objects.get(name="late", kind="released")
    assert "already expired" in event.detail


def test_break_and_the_holders_loss_are_recorded(audit):
    lease = acquire("victim", ttl=30, holder="doomed")
    assert break_lock("victim", by="alice") is True
    with pytest.raises(LockLost):
        lease.renew()
    assert kinds("victim") == ["acquired", "broken", "lost"]
    broken = LockEvent.objects.get(name="victim", kind="broken")
    assert (broken.by, broken.token, broken.owner) == ("alice", lease.token, lease.owner)
    assert broken.holder.endswith("doomed")
    lost = LockEvent.objects.get(name="victim", kind="lost")
    assert "broken" in lost.detail


def test_renewals_from_the_auto_renew_thread_are_recorded(audit):
    lease = acquire("auto", ttl=1.5, auto_renew=True)  # room for a late renewer thread
    deadline = time.monotonic() + 10
    while LockEvent.objects.filter(name="auto", kind="renewed").count() < 2:
        assert time.monotonic() < deadline, "no renewals were recorded"
        time.sleep(0.02)
    lease.release()
    assert kinds("auto")[0] == "acquired" and kinds("auto")[-1] == "released"


def test_stale_write_refused_is_recorded(audit):
    account = Account.objects.create(balance=1)
    lease = acquire(f"account:{account.pk}", ttl=30)
    make_stale(lease)
    newer = acquire(f"account:{account.pk}", ttl=30)
    account.balance = 99
    with pytest.raises(StaleToken):
        account.save(fence=lease)
    event = LockEvent.objects.get(name=f"account:{account.pk}", kind="stale_write")
    assert event.token == lease.token and event.owner == lease.owner
    assert "testapp.Account" in event.detail and str(lease.token) in event.detail
    assert event.get_kind_display() == "stale write refused"
    assert newer.release() is True


def _expired(lease):
    make_stale(lease)
    return "lease expired"


def _taken_over(lease):
    newer = take_over(lease)
    return f"lock now at token {newer.token}"


def _broken(lease):
    assert break_lock(lease.name, by="ops") is True
    return "lease broken"


def _released(lease):
    assert lease.release() is True
    return "lock released"


@pytest.mark.parametrize("end", [_expired, _taken_over, _broken, _released])
def test_a_stale_write_record_says_why_it_was_refused(audit, end):
    """Issue 34: "write with token 4 refused (row token 3)" alone read as if a higher token
    had been refused; the reason the exception gave is now in the record too."""
    account = Account.objects.create(balance=1)
    lease = acquire(f"account:{account.pk}", ttl=30)
    Account.objects.filter(pk=account.pk).fenced_update(lease, balance=2)
    reason = end(lease)
    with pytest.raises(StaleToken):
        account.save(fence=lease)
    event = LockEvent.objects.get(name=lease.name, kind="stale_write")
    assert event.detail == (
        f"write with token {lease.token} refused: {reason} "
        f"(testapp.Account; row token {lease.token})"
    )


def test_a_stale_write_past_a_newer_write_names_the_rows_token(audit):
    """Without the ownership check, the high-water mark refuses: the row's newer token."""
    account = HighWaterAccount.objects.create()
    lease = acquire(f"account:{account.pk}", ttl=30)
    newer = take_over(lease)
    HighWaterAccount.objects.filter(pk=account.pk).fenced_update(newer, balance=5)
    with pytest.raises(StaleToken):
        account.save(fence=lease)
    event = LockEvent.objects.get(name=lease.name, kind="stale_write")
    assert f"refused: row already written by token {newer.token} " in event.detail


def test_a_refusal_caught_inside_the_callers_transaction_is_recorded_with_its_reason(audit):
    """The refusal's savepoint is rolled back, the record is not: a caller that catches
    StaleToken and commits keeps it (as before the reason was added)."""
    account = Account.objects.create()
    lease = acquire(f"account:{account.pk}", ttl=30)
    make_stale(lease)
    with transaction.atomic(), pytest.raises(StaleToken):
        account.save(fence=lease)
    assert "refused: lease expired" in LockEvent.objects.get(kind="stale_write").detail


def test_a_stale_write_detail_fits_its_column_and_keeps_the_reason(audit):
    """detail is 500 characters: a long model label is cut before the reason, and a
    reason longer than the column is cut with an ellipsis (MariaDB would refuse more)."""
    lease = acquire("long", ttl=30)
    model = type("M" * 600, (), {})
    signals.stale_write_refused.send(sender=model, lease=lease, instance_token=3,
                                     reason="lease expired")
    signals.stale_write_refused.send(sender=Account, lease=lease, instance_token=3,
                                     reason="r" * 600)
    short, long = LockEvent.objects.filter(kind="stale_write").order_by("id")
    assert len(short.detail) == len(long.detail) == 500
    assert short.detail.startswith(f"write with token {lease.token} refused: lease expired (")
    assert short.detail.endswith("M…") and long.detail.endswith("r…")
    assert fit("head", " tail", limit=9) == "head tail"
    assert fit("head", " tail", limit=8) == "head ta…"
    lease.release()


@pytest.mark.django_db(transaction=True, databases=["default", "locks"])
def test_events_go_to_the_lock_database(audit, settings):
    if connection.vendor == "sqlite":
        pytest.skip("SQLite: the 'locks' alias is the same file; nothing to tell apart")
    settings.DISTLOCK_DATABASE = "locks"
    lease = acquire("routed", ttl=30)
    lease.release()
    assert LockEvent.objects.using("locks").filter(name="routed").count() == 2
    connections["locks"].close()


def test_a_failing_audit_insert_does_not_break_locking(audit, caplog):
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE distlock_lockevent RENAME TO distlock_lockevent_away")
    try:
        with caplog.at_level(logging.ERROR, logger="distlock.ops.audit"):
            lease = acquire("sturdy", ttl=30)
            assert lease is not None
            assert lease.release() is True
        assert "could not record acquired of lock 'sturdy'" in caplog.text
        assert "could not record released" in caplog.text
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE distlock_lockevent_away RENAME TO distlock_lockevent")
    assert Lock.objects.get(name="sturdy").is_free


def test_a_failing_audit_insert_leaves_the_callers_transaction_usable(audit, caplog):
    """The insert runs in a savepoint: on PostgreSQL a failed statement would otherwise
    abort the caller's whole transaction, which caught the StaleToken and goes on."""
    account = Account.objects.create()
    lease = acquire(f"account:{account.pk}", ttl=30)
    make_stale(lease)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE distlock_lockevent RENAME TO distlock_lockevent_away")
    try:
        with caplog.at_level(logging.ERROR, logger="distlock.ops.audit"), transaction.atomic():
            with pytest.raises(StaleToken):
                account.save(fence=lease)
            Account.objects.create(balance=7)  # the caller's own work goes on
        assert "could not record stale_write" in caplog.text
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE distlock_lockevent_away RENAME TO distlock_lockevent")
    assert Account.objects.filter(balance=7).exists()


def test_purge_events_by_age(audit):
    acquire("p", ttl=30).release()
    now = db_now_us("default")
    LockEvent.objects.filter(kind="acquired").update(at_us=now - 10 * 86400 * 1_000_000)
    assert purge_events(older_than=86400) == 1
    assert kinds("p") == ["released"]
    assert purge_events() == 0  # default retention: 30 days


def test_purge_events_goes_oldest_first_in_bounded_batches(audit):
    for i in range(5):
        acquire(f"old:{i}", ttl=30).release()  # 10 events: acquired and released
    now = db_now_us("default")
    LockEvent.objects.update(at_us=now - 10 * 86400 * 1_000_000)
    acquire("new", ttl=30).release()
    cutoff = now - 86400 * 1_000_000
    assert [d for d, _ in event_batches("default", cutoff, size=4, rest=0.0)] == [4, 4, 2]
    assert sorted(set(LockEvent.objects.values_list("name", flat=True))) == ["new"]


def test_purge_events_uses_the_retention_setting(audit, settings):
    acquire("r", ttl=30).release()
    LockEvent.objects.update(at_us=db_now_us("default") - 7200 * 1_000_000)
    settings.DISTLOCK_AUDIT_RETENTION = None
    assert purge_events() == 0
    settings.DISTLOCK_AUDIT_RETENTION = 3600
    assert purge_events() == 2


@pytest.mark.parametrize(
    ("older_than", "error"),
    [(-1, ValueError), ("1d", TypeError), (float("nan"), ValueError), (True, TypeError)],
)
def test_purge_events_bad_input_deletes_nothing(audit, older_than, error):
    acquire("keep", ttl=30).release()
    LockEvent.objects.update(at_us=0)
    with pytest.raises(error):
        purge_events(older_than=older_than)
    with pytest.raises(ValueError):
        purge_events(older_than=1, using="nope")
    assert LockEvent.objects.count() == 2


def test_audit_setting_checks(settings):
    assert check_audit_settings() == []
    settings.DISTLOCK_AUDIT = "yes"
    settings.DISTLOCK_AUDIT_RETENTION = 0
    assert [m.id for m in check_audit_settings()] == ["distlock.E020", "distlock.E021"]
    settings.DISTLOCK_AUDIT = True
    settings.DISTLOCK_AUDIT_RETENTION = "30d"
    assert [m.id for m in check_audit_settings()] == ["distlock.E021"]
    settings.DISTLOCK_AUDIT_RETENTION = 10**400
    [message] = check_audit_settings()
    assert message.id == "distlock.E021" and "out of range" in message.msg


def test_renewed_signal_carries_the_lease():
    seen = []

    def receiver(sender, lease, **kwargs):
        seen.append((lease.token, lease.expires_at, threading.current_thread().name))

    signals.lock_renewed.connect(receiver)
    try:
        lease = acquire("sig", ttl=30)
        lease.renew(ttl=40)
        assert seen == [(lease.token, lease.expires_at, threading.current_thread().name)]
        break_lock("sig")
        with pytest.raises(LockLost):
            lease.renew()
        assert len(seen) == 1  # a failed renewal sends lock_lost, not lock_renewed
    finally:
        signals.lock_renewed.disconnect(receiver)
