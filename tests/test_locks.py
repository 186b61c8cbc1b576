"""acquire(), lock(), locked() and Lease on the configured backend."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections, transaction

import distlock
from distlock import (
    LockLost,
    LockTimeout,
    TransactionNotAllowed,
    acquire,
    break_lock,
    current_lease,
    lock,
    locked,
    purge_locks,
)
from distlock.backends import backend_for
from distlock.backends.results import Busy
from distlock.constants import PURGE_REST_MAX
from distlock.core import locks as core_locks
from distlock.core.purge import purge_batches
from distlock.db import db_now_us
from distlock.models import Lock, TokenFloor
from tests.support.helpers import us

pytestmark = pytest.mark.usefixtures("lock_db")


def test_acquire_gives_a_committed_lease():
    lease = acquire("invoice:1", ttl=30)
    assert lease is not None
    assert lease.name == "invoice:1" and lease.token >= 1 and len(lease.owner) == 32
    row = Lock.objects.get(name="invoice:1")
    assert (row.owner, row.token) == (lease.owner, lease.token)
    assert row.expires_at == lease.expires_at
    assert 29 < lease.remaining() <= 30
    assert lease.release() is True
    row.refresh_from_db()
    assert row.owner == "" and row.is_free


def test_second_acquire_is_refused_while_held():
    first = acquire("a", ttl=30)
    assert acquire("a", ttl=30, blocking=False) is None
    assert acquire("a", ttl=30, timeout=0.05) is None
    with pytest.raises(LockTimeout) as caught, lock("a", timeout=0):
        pass
    assert isinstance(caught.value, TimeoutError)
    first.release()
    second = acquire("a", ttl=30, blocking=False)
    assert second is not None and second.token == first.token + 1


def test_tokens_increase_by_one_per_grant_of_a_name():
    tokens = []
    for _ in range(5):
        with lock("counter", ttl=5) as lease:
            tokens.append(lease.token)
    assert tokens == list(range(tokens[0], tokens[0] + 5))


def test_names_compare_exactly():
    names = ["lock", "LOCK", "lock ", "lóck", "lo\u0301ck"]
    leases = [acquire(name, ttl=30, blocking=False) for name in names]
    assert all(lease is not None for lease in leases)
    assert sorted(Lock.objects.values_list("name", flat=True)) == sorted(names)


# Characters that mean something to SQL, to a driver's placeholders or to an escaper.
SQL_NAMES = ["it's", 'say "hi"', "back\\slash\\", "%s %% %(x)s", "semi; -- colon", "\u2603 ☃"]


@pytest.mark.parametrize("escapes", ["default", "no_backslash_escapes"])
def test_names_with_sql_characters_are_the_same_lock_in_every_operation(escapes):
    """Each backend sends names its own way (PostgreSQL's wire cursor as parameters,
    MariaDB's CALLs as escaped literals, SQLite's ``?``): the name stored, refused to a
    second acquire, renewed and released must be the one given, on a MariaDB session with
    NO_BACKSLASH_ESCAPES too."""
    if escapes == "no_backslash_escapes":
        if connection.vendor != "mysql":
            pytest.skip("a MariaDB/MySQL session setting")
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION sql_mode = CONCAT(@@sql_mode, ',NO_BACKSLASH_ESCAPES')")
    try:
        leases = [acquire(name, ttl=30, blocking=False) for name in SQL_NAMES]
        assert all(lease is not None for lease in leases)
        assert sorted(Lock.objects.values_list("name", flat=True)) == sorted(SQL_NAMES)
        for name, lease in zip(SQL_NAMES, leases, strict=True):
            assert acquire(name, ttl=30, blocking=False) is None
            lease.renew(ttl=60)
            assert Lock.objects.get(name=name).renew_count == 1
            assert lease.release() is True
        assert not Lock.objects.exclude(owner="").exists()
    finally:
        if escapes == "no_backslash_escapes":
            connection.close()  # the next test's session starts with the server's sql_mode


def test_renew_extends_and_keeps_the_token():
    lease = acquire("r", ttl=1)
    before = lease.expires_at
    lease.renew(ttl=30)
    assert lease.expires_at > before and 29 < lease.remaining() <= 30
    row = Lock.objects.get(name="r")
    assert row.token == lease.token and row.renew_count == 1
    assert row.expires_at == lease.expires_at


def test_expired_lock_is_taken_over_with_a_higher_token():
    old = acquire("x", ttl=0.2)
    deadline = old.expires_at
    new = acquire("x", ttl=30, timeout=5)
    assert new is not None and new.token == old.token + 1
    assert new.acquired_at >= deadline
    assert old.release() is False
    with pytest.raises(LockLost):
        old.renew()
    row = Lock.objects.get(name="x")
    assert (row.owner, row.token) == (new.owner, new.token)


def test_blocking_acquire_gets_the_lock_when_released():
    holder = acquire("b", ttl=30)
    got = []
    waiter = threading.Thread(
        target=lambda: (got.append(acquire("b", ttl=30, timeout=10)), connections.close_all())
    )
    waiter.start()
    # The waiter must be polling before the release for this to test waiting at all.
    holder.release()
    waiter.join(15)
    assert got and got[0] is not None and got[0].token == holder.token + 1


# A back-off pause far longer than any bound below: a pause that ignored the holder's
# expiry or the acquire's deadline is 15-30 s (jittered down to half), noticed by seconds.
LONG_BACK_OFF = 30.0


def _long_back_off(settings: Any) -> None:
    settings.DISTLOCK_POLL_INTERVAL = LONG_BACK_OFF
    settings.DISTLOCK_POLL_MAX_INTERVAL = LONG_BACK_OFF
    # PostgreSQL too: the polling pause of every backend, not a queued waiter's LISTEN.
    settings.DISTLOCK_WAKEUPS = False


def test_a_polling_waiter_wakes_just_after_the_holders_expiry(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder that never releases (hung, killed) keeps a waiter for its ttl, not for a
    whole back-off pause after it: a refused try says how long the holder's lease has left
    by the database's count, and the pause ends just after that. Measured by the database
    clock, from the holder's expiry to the waiter's grant; the waiter's pauses are
    recorded (the real function, called through) to know its first try was refused."""
    _long_back_off(settings)
    pauses: list[float] = []
    pause_before_retry = core_locks.pause_before_retry

    def recorded(attempt: int, busy: Busy, left: float | None) -> float:
        pause = pause_before_retry(attempt, busy, left)
        pauses.append(pause)
        return pause

    monkeypatch.setattr(core_locks, "pause_before_retry", recorded)
    holder = acquire("wake-at-expiry", ttl=3)
    lease = acquire("wake-at-expiry", ttl=30, timeout=120)
    assert pauses, "the waiter's first try was not refused: it never waited"
    assert lease is not None and lease.token == holder.token + 1
    late = us(lease.acquired_at) - us(holder.expires_at)
    # 3 s: scheduling on a loaded machine; a pause that ignored the expiry is 12 s late.
    assert 0 <= late < 3_000_000, f"granted {late / 1e6:.3f} s after the holder's expiry"
    assert lease.release() is True


@pytest.mark.parametrize("form", ["acquire", "lock"])
def test_a_blocking_acquire_gives_up_at_its_timeout_however_long_the_back_off(
    settings: Any, form: str
) -> None:
    """``timeout`` bounds the wait, pauses included: with a back-off far longer than the
    timeout, ``acquire`` returns None (``lock`` raises LockTimeout) about ``timeout``
    seconds after the call, not after the pause it would have slept."""
    _long_back_off(settings)
    holder = acquire("give-up", ttl=120)
    started = time.monotonic()
    if form == "acquire":
        assert acquire("give-up", ttl=30, timeout=1) is None
    else:
        with pytest.raises(LockTimeout), lock("give-up", ttl=30, timeout=1):
            pass
    waited = time.monotonic() - started
    # 1 s at least (it waited its timeout); 8 s: a loaded machine, far below the 15 s of
    # the shortest pause that ignored the deadline.
    assert 1.0 <= waited < 8.0, f"gave up after {waited:.3f} s"
    row = Lock.objects.get(name="give-up")
    assert (row.owner, row.token) == (holder.owner, holder.token)
    assert holder.release() is True


def test_lock_context_sets_current_lease_and_releases_on_error():
    assert current_lease() is None
    with pytest.raises(RuntimeError), lock("ctx", ttl=30) as lease:
        assert current_lease() is lease
        raise RuntimeError("boom")
    assert current_lease() is None
    assert Lock.objects.get(name="ctx").is_free


def test_lock_as_decorator_and_locked_template():
    seen = []

    @lock("deco", ttl=30)
    def plain():
        seen.append(current_lease().name)

    @locked("report:{customer_id}:{kind}", ttl=30)
    def report(customer_id, kind="daily"):
        seen.append(current_lease().name)
        return customer_id

    plain()
    assert report(7) == 7
    assert seen == ["deco", "report:7:daily"]
    assert Lock.objects.get(name="report:7:daily").is_free


async def _coroutine_function(customer_id):
    return customer_id


async def _async_generator_function(customer_id):
    yield customer_id


@pytest.mark.parametrize(
    ("func", "kind"),
    [(_coroutine_function, "a coroutine function"),
     (_async_generator_function, "an async generator function")],
)
@pytest.mark.parametrize(
    ("decorator", "label"),
    [(lock("async", ttl=30), "@lock(...)"),
     (locked("async:{customer_id}", ttl=30), "@locked(...)")],
)
def test_async_functions_are_refused_at_decoration(decorator, label, func, kind):
    """A sync lock around an async def would guard only the creation of the coroutine:
    refused when decorating, with what to do instead."""
    with pytest.raises(TypeError) as caught:
        decorator(func)
    message = str(caught.value)
    assert message.startswith(f"{label} cannot guard {func.__qualname__}(), {kind}")
    assert "alock/alocked" in message and "sync_to_async" in message
    assert not Lock.objects.exists()


def test_sync_to_async_wrapped_functions_are_refused_too():
    from asgiref.sync import sync_to_async

    with pytest.raises(TypeError, match="a coroutine function"):
        lock("async", ttl=30)(sync_to_async(lambda: None))


def test_locked_rejects_a_template_field_that_is_not_a_parameter():
    with pytest.raises(ValueError, match="customer"):

        @locked("report:{customer}")
        def report(customer_id):
            pass


def test_auto_renew_keeps_the_lease_and_stops_on_release():
    # Renewals every 2/3 s: a ttl of 0.3 s (every 0.1 s) lost its lease in CI when the
    # loaded machine kept the renewer thread off the CPU for longer than 0.2 s.
    lease = acquire("auto", ttl=2.0, auto_renew=True)
    first_expiry = lease.expires_at
    renewals = 0
    deadline = db_now_us("default") + 10_000_000
    while renewals < 2 and db_now_us("default") < deadline:
        renewals = Lock.objects.get(name="auto").renew_count
    assert renewals >= 2
    assert lease.expires_at > first_expiry and not lease.lost
    assert lease.release() is True
    count = Lock.objects.get(name="auto").renew_count
    assert lease._renewer is None
    assert Lock.objects.get(name="auto").renew_count == count


def test_auto_renew_failure_marks_lost_and_calls_back():
    lost = threading.Event()
    lease = acquire("auto2", ttl=0.3, auto_renew=True, on_lost=lambda lease, exc: lost.set())
    assert break_lock("auto2")
    assert lost.wait(5)
    assert lease.lost
    with pytest.raises(LockLost):
        lease.check()
    with pytest.raises(LockLost):
        lease.renew()
    assert lease.release() is False


def test_break_lock_checks_owner_and_token():
    lease = acquire("brk", ttl=30)
    assert break_lock("brk", token=lease.token + 1) is False
    assert break_lock("brk", owner="0" * 32) is False
    assert Lock.objects.get(name="brk").owner == lease.owner
    assert break_lock("brk", owner=lease.owner, token=lease.token) is True
    assert break_lock("brk") is False
    assert lease.release() is False
    again = acquire("brk", ttl=30)
    assert again.token == lease.token + 1


def test_inside_atomic_on_the_lock_database_is_refused_and_writes_nothing():
    with transaction.atomic(), pytest.raises(TransactionNotAllowed, match="DISTLOCK_DATABASE"):
        acquire("in-atomic", ttl=30)
    assert not Lock.objects.filter(name="in-atomic").exists()


@pytest.mark.django_db(transaction=True, databases=["default", "locks"])
def test_separate_alias_outer_rollback_never_repeats_a_token(settings):
    settings.DISTLOCK_DATABASE = "locks"
    if connections["locks"].vendor == "sqlite":
        # One writer per SQLite file: a second connection cannot lock inside atomic().
        with transaction.atomic(), pytest.raises(TransactionNotAllowed, match="SQLite"):
            acquire("rollback", ttl=30)
        assert not Lock.objects.filter(name="rollback").exists()
        return
    tokens = []
    for _ in range(2):
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            lease = acquire("rollback", ttl=30)
            tokens.append(lease.token)
            assert lease.release() is True
            1 / 0  # noqa: B018 - roll the outer transaction back
    assert tokens[1] == tokens[0] + 1
    assert Lock.objects.using("locks").get(name="rollback").token == tokens[1]
    connections["locks"].close()


def test_purge_keeps_tokens_increasing():
    first = acquire("p1", ttl=30)
    first.release()
    other = acquire("p2", ttl=30)
    other.release()
    assert purge_locks(idle=0) == 2  # the floor remembers p2's token: no row need stay
    assert not Lock.objects.exists()
    assert TokenFloor.objects.get().token == other.token
    again = acquire("p1", ttl=30)
    assert again.token > first.token and again.token > other.token
    again.release()
    assert purge_locks(idle=timedelta(hours=1)) == 0


def test_purge_deletes_in_batches_and_raises_the_floor(monkeypatch):
    monkeypatch.setattr("distlock.core.purge.PURGE_BATCH", 3)
    leases = [acquire(f"batch:{i}", ttl=30) for i in range(8)]
    for lease in leases[1:]:
        lease.release()
    assert purge_locks(idle=0) == 7
    assert list(Lock.objects.values_list("name", flat=True)) == ["batch:0"]
    assert TokenFloor.objects.get().token == max(lease.token for lease in leases[1:])
    assert acquire("batch:7", ttl=30).token == leases[7].token + 1
    assert leases[0].release() is True


def test_purge_batches_are_bounded_and_rest_after_deleting(lock_db):
    for i in range(7):
        acquire(f"rest:{i}", ttl=30).release()
    held = acquire("rest:held", ttl=30)
    seen, gaps = [], []
    last = None
    for deleted, took in purge_batches(lock_db, 0, size=3, rest=2.0):
        now = time.monotonic()
        if last is not None:
            gaps.append((now - last[0], last[1], took))
        seen.append(deleted)
        last = (now, took)
    # 8 names in name order, 3 a batch: the held one is looked at, never deleted.
    assert seen == [3, 3, 1]
    for gap, before, took in gaps:  # rested twice the deleting batch's time (capped)
        assert gap >= min(2.0 * before, PURGE_REST_MAX) + took
    assert list(Lock.objects.values_list("name", flat=True)) == ["rest:held"]
    assert held.release() is True


def test_purge_batches_do_not_rest_when_told_not_to(lock_db):
    for i in range(4):
        acquire(f"norest:{i}", ttl=30).release()
    assert [d for d, _ in purge_batches(lock_db, 0, size=2, rest=0.0)] == [2, 2, 0]


def test_first_use_puts_a_missing_floor_back_from_the_table():
    acquire("kept", ttl=30).release()
    top = acquire("top", ttl=30)
    top.release()
    TokenFloor.objects.all().delete()  # as a flush leaves it
    assert acquire("fresh", ttl=30).token == top.token + 1
    assert TokenFloor.objects.get().token == top.token


def test_purge_leaves_held_locks():
    held = acquire("held", ttl=30)
    assert purge_locks(idle=0) == 0
    assert held.release() is True


def test_import_distlock_is_lazy_and_complete():
    for name in distlock.__all__:
        assert getattr(distlock, name) is not None
    with pytest.raises(AttributeError):
        distlock.nothing_here  # noqa: B018


def test_holder_deadline_is_never_later_than_the_databases():
    for _ in range(20):
        lease = acquire("deadline", ttl=5)
        db_now = db_now_us("default")
        left_by_db = (lease.expires_at - Lock(expires_us=db_now).expires_at).total_seconds()
        # remaining() is read after the database clock: it must be the smaller of the two.
        assert lease.remaining() <= left_by_db
        lease.release()


def test_token_overflow_raises_and_grants_nothing():
    from distlock import TokenExhausted
    from distlock.validation import MAX_TOKEN

    acquire("full", ttl=5).release()
    Lock.objects.filter(name="full").update(token=MAX_TOKEN)
    with pytest.raises(TokenExhausted):
        acquire("full", ttl=5, blocking=False)
    # A new name would have to start above the token floor.
    TokenFloor.objects.update_or_create(id=1, defaults={"token": MAX_TOKEN})
    with pytest.raises(TokenExhausted):
        acquire("brand-new", ttl=5, blocking=False)
    row = Lock.objects.get(name="full")
    assert (row.token, row.owner) == (MAX_TOKEN, "")
    assert not Lock.objects.filter(name="brand-new").exists()


def test_release_is_idempotent_and_lock_can_be_reacquired_at_once():
    lease = acquire("twice", ttl=5)
    assert lease.release() is True
    assert lease.release() is False
    assert lease.released_at is not None and lease.remaining() == 0
    with pytest.raises(LockLost):
        lease.check()
    assert acquire("twice", ttl=5, blocking=False).token == lease.token + 1


def _hold_row_lock(name: str, locked: threading.Event, release: threading.Event,
                   problems: list[str]) -> None:
    """In a thread with its own connection: keep lock row ``name`` locked by an open
    transaction (as a fenced write's locking read or a break in flight does) until told."""
    try:
        with transaction.atomic():
            Lock.objects.select_for_update().get(name=name)
            locked.set()
            if not release.wait(60):
                problems.append("the row lock was never released by the test")
    except Exception as exc:  # noqa: BLE001 - reported by the test thread
        problems.append(repr(exc))
    finally:
        connections.close_all()


SESSION_SET = pytest.mark.no_pooler(
    "a session SET applies to whichever pooled server connection it lands on (and stays there)"
)


@pytest.mark.parametrize(
    ("vendor", "set_limit", "reset_limit"),
    [
        pytest.param("postgresql", "SET lock_timeout = '100ms'", "RESET lock_timeout",
                     marks=SESSION_SET),
        pytest.param("postgresql", "SET statement_timeout = '100ms'", "RESET statement_timeout",
                     marks=SESSION_SET),
        ("mysql", "SET SESSION innodb_lock_wait_timeout = 1",
         "SET SESSION innodb_lock_wait_timeout = DEFAULT"),
    ],
    ids=["pg-lock_timeout", "pg-statement_timeout", "mariadb-innodb_lock_wait_timeout"],
)
def test_a_lock_wait_cut_short_by_the_session_is_busy_not_an_error(
    vendor, set_limit, reset_limit
):
    if connection.vendor == "sqlite":
        pytest.skip(
            "SQLite has no row locks and no per-session lock wait limit: its busy timeout "
            "(OPTIONS['timeout'], checked by E004) is the analogue, and running out of it "
            "stays an OperationalError"
        )
    if connection.vendor != vendor:
        pytest.skip(f"{vendor} only: this session setting (this run: {connection.vendor})")
    first = acquire("cut-short", ttl=30)
    assert first.release() is True  # free: PostgreSQL's acquire must take the row lock
    locked, release, problems = threading.Event(), threading.Event(), []
    holder = threading.Thread(
        target=_hold_row_lock, args=("cut-short", locked, release, problems)
    )
    cut_short = []

    def watch(execute, sql, params, many, context):
        try:
            return execute(sql, params, many, context)
        except DatabaseError as exc:
            if backend_for(connection).lock_wait_cut_short(exc):
                cut_short.append(sql)
                release.set()  # let the other transaction commit after the first refusal
            raise

    with connection.cursor() as cursor:
        cursor.execute(set_limit)
    holder.start()
    try:
        assert locked.wait(30), "the other transaction never locked the row"
        started = time.monotonic()
        assert acquire("cut-short", ttl=30, blocking=False) is None
        assert time.monotonic() - started < 10  # the limit (0.1 s / 1 s), not a long wait
        assert Lock.objects.get(name="cut-short").owner == ""
        assert holder.is_alive() and not release.is_set()

        with connection.execute_wrapper(watch):
            lease = acquire("cut-short", ttl=30, timeout=60)
        assert cut_short, "the blocking acquire never had its lock wait cut short"
        assert lease is not None and lease.token == first.token + 1
        row = Lock.objects.get(name="cut-short")
        assert (row.owner, row.token) == (lease.owner, lease.token)
        assert lease.release() is True
    finally:
        release.set()
        holder.join(60)
        with connection.cursor() as cursor:
            cursor.execute(reset_limit)
    assert not holder.is_alive() and problems == []

