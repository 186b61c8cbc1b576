"""Bad input (DESIGN invariant 9): a clear exception, and the lock table unchanged."""

from __future__ import annotations

import math
from datetime import timedelta
from decimal import Decimal

import pytest

from distlock import (
    Lease,
    aacquire,
    aacquire_all,
    acquire,
    acquire_all,
    alock,
    alock_all,
    alocked,
    break_lock,
    lock,
    lock_all,
    lock_status,
    locked,
    purge_locks,
)
from distlock.models import Lock, LockEvent
from distlock.ops.audit import purge_events
from distlock.validation import MAX_SECONDS
from tests.support.helpers import run_async

pytestmark = pytest.mark.usefixtures("lock_db")


@pytest.fixture
def unchanged():
    """Holds a lock while the test runs and checks every row is the same afterwards."""
    lease = acquire("guard", ttl=60)
    before = list(Lock.objects.order_by("name").values())
    yield lease
    assert list(Lock.objects.order_by("name").values()) == before


BAD_NAMES = [
    (None, TypeError), (42, TypeError), (b"bytes", TypeError), (["a"], TypeError),
    ("", ValueError), ("x" * 256, ValueError), ("x" * 10_000, ValueError),
    ("nul\x00byte", ValueError), ("lone \ud800 surrogate", ValueError),
]
BAD_TTLS = [
    (0, ValueError), (-1, ValueError), (0.0001, ValueError), (math.nan, ValueError),
    (math.inf, ValueError), (-math.inf, ValueError), (10**12, ValueError),
    (timedelta(days=-1), ValueError), (timedelta(days=2), ValueError),
    (True, TypeError), ("30", TypeError), (object(), TypeError), (Decimal("NaN"), ValueError),
    # Beyond a float (an int or a Decimal) or a timedelta's extremes: ValueError, never
    # OverflowError.
    (10**400, ValueError), (-(10**400), ValueError), (Decimal("1e400"), ValueError),
    (Decimal("-Infinity"), ValueError), (timedelta.max, ValueError),
    (timedelta.min, ValueError),
]
BAD_TIMEOUTS = [
    (-1, ValueError), (math.nan, ValueError), (math.inf, ValueError), (True, TypeError),
    ("10", TypeError), (timedelta(seconds=-5), ValueError),
    (10**400, ValueError), (-(10**400), ValueError), (Decimal("1e400"), ValueError),
    (Decimal("-1e400"), ValueError), (Decimal("sNaN"), ValueError),
    (timedelta.max, ValueError), (timedelta.min, ValueError), (1e300, ValueError),
    (MAX_SECONDS + 1, ValueError),
]
# What purge_locks(idle=) and purge_events(older_than=) refuse, with the same errors.
BAD_AGES = [
    (-1, ValueError), ("1 day", TypeError), (math.nan, ValueError), (10**400, ValueError),
    (Decimal("1e400"), ValueError), (timedelta.max, ValueError), (1e300, ValueError),
    (timedelta.min, ValueError),
]


@pytest.mark.parametrize(("name", "error"), BAD_NAMES)
def test_bad_names(unchanged, name, error):
    with pytest.raises(error):
        acquire(name, ttl=10)
    with pytest.raises(error):
        lock(name)
    with pytest.raises(error):
        break_lock(name)


# The row names of semaphores and read/write locks, and names that only look like them.
RESERVED = [
    "exports#permits", "exports#permit:0", "exports#permit:31", "doc#rw", "doc#write",
    "doc#read:0", "doc#read:31", "#rw",
]
NOT_RESERVED = [
    "exports#permit", "exports#permits:", "exports#permit:", "exports#permit:x",
    "doc#rwx", "doc#writer", "doc#read:", "doc#read:1a", "doc#rw ", "doc#Write", "issue#42",
]


@pytest.mark.parametrize("name", RESERVED)
def test_row_names_of_semaphores_and_rwlocks_are_refused_to_plain_locks(unchanged, name):
    """Every plain-lock entry point, sync and async, refuses the name before any SQL;
    the row stays readable and breakable (the admin's way to free a stuck permit)."""
    reserved = f"{name!r} ends in a suffix reserved"
    sync_calls = [
        lambda: acquire(name, ttl=10), lambda: acquire(name, ttl=10, blocking=False),
        lambda: lock(name), lambda: locked(name)(lambda: None)(),
        lambda: acquire_all(["ok", name]), lambda: lock_all(["ok", name]),
    ]
    for call in sync_calls:
        with pytest.raises(ValueError, match=reserved):
            call()

    async def noop() -> None:
        return None

    async_calls = [
        lambda: aacquire(name, ttl=10), lambda: alock(name).__aenter__(),
        lambda: alocked(name)(noop)(), lambda: aacquire_all(["ok", name]),
        lambda: alock_all(["ok", name]).__aenter__(),
    ]
    for make in async_calls:
        with pytest.raises(ValueError, match=reserved):
            run_async(make)
    assert lock_status(name).held is False
    assert break_lock(name) is False


@pytest.mark.parametrize("name", NOT_RESERVED)
def test_names_that_only_look_reserved_are_plain_locks(name):
    lease = acquire(name, ttl=10)
    assert lease is not None and lease.name == name
    assert lease.release() is True
    with lock(name) as held:
        assert held.name == name


@pytest.mark.parametrize(("ttl", "error"), BAD_TTLS)
def test_bad_ttls(unchanged, ttl, error):
    with pytest.raises(error):
        acquire("ttl", ttl=ttl)
    with pytest.raises(error):
        lock("ttl", ttl=ttl)
    with pytest.raises(error):
        unchanged.renew(ttl=ttl)
    assert not unchanged.lost


@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS)
def test_bad_timeouts(unchanged, timeout, error):
    with pytest.raises(error):
        acquire("timeout", ttl=10, timeout=timeout)
    with pytest.raises(error):
        lock("timeout", timeout=timeout)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"using": "nowhere"}, ValueError),
        ({"using": 3}, TypeError),
        ({"blocking": "no"}, TypeError),
        ({"holder": 5}, TypeError),
        # Stored by SQLite and MariaDB, a DataError on PostgreSQL: refused everywhere.
        ({"holder": "worker\x00one"}, ValueError),
        ({"holder": "lone \ud800 surrogate"}, ValueError),
    ],
)
def test_bad_options(unchanged, kwargs, error):
    with pytest.raises(error):
        acquire("options", ttl=10, **kwargs)
    if "holder" in kwargs:
        with pytest.raises(error):
            lock("options", holder=kwargs["holder"])


def test_huge_numbers_say_what_is_out_of_range(unchanged):
    """The message names the argument and the limit, and does not print 400 digits."""
    with pytest.raises(ValueError, match=r"^ttl of 1\.000e\+400 s is out of range") as caught:
        acquire("huge", ttl=10**400)
    assert len(str(caught.value)) < 200
    with pytest.raises(ValueError, match="use timeout=None to wait without a limit"):
        acquire("huge", ttl=10, timeout=10**400)
    with pytest.raises(ValueError, match=r"^ttl of 1E\+400 s is out of range"):
        unchanged.renew(ttl=Decimal("1e400"))
    with pytest.raises(ValueError, match=r"^idle of 999999999 days, 23:59:59\.999999 is out"):
        purge_locks(idle=timedelta.max)
    assert not unchanged.lost


def test_the_longest_durations_work_on_every_backend():
    """At the limit, microseconds still fit the database's 64-bit integers (SQLite would
    raise OverflowError, the servers compute in numeric, beyond them)."""
    acquire("idle", ttl=10).release()
    lease = acquire("long-wait", ttl=10, timeout=MAX_SECONDS)
    assert lease is not None and Lock.objects.get(name="long-wait").owner == lease.owner
    assert purge_locks(idle=MAX_SECONDS) == 0
    assert purge_locks(idle=timedelta(seconds=MAX_SECONDS)) == 0
    assert purge_events(older_than=MAX_SECONDS) == 0
    assert purge_locks(idle=0) == 1  # the idle row is there to be purged
    assert list(Lock.objects.values_list("name", flat=True)) == ["long-wait"]


def test_long_holder_descriptions_are_still_cut_to_the_column():
    lease = acquire("long-holder", ttl=10, holder="h" * 1000)
    row = Lock.objects.get(name="long-holder")
    assert len(row.holder) == 255 and row.holder == lease.holder
    assert row.holder.endswith("hhhh") and "pid=" in row.holder
    lease.release()


@pytest.mark.parametrize(
    ("by", "error"),
    [(12345, TypeError), (None, TypeError), (b"ops", TypeError), ("ops\x00", ValueError),
     ("lone \ud800", ValueError)],
)
def test_bad_break_by_is_refused_before_the_lock_is_broken(unchanged, settings, by, error):
    settings.DISTLOCK_AUDIT = True
    with pytest.raises(error, match="^by "):
        break_lock("guard", by=by)
    assert not LockEvent.objects.exists()  # no "broken" event: nothing was broken


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"token": "1"}, TypeError), ({"token": True}, TypeError), ({"token": 0}, ValueError),
        ({"token": 2**63}, ValueError), ({"owner": "not hex"}, ValueError),
        ({"owner": 12}, TypeError), ({"owner": "A" * 32}, ValueError),
    ],
)
def test_bad_break_guards(unchanged, kwargs, error):
    with pytest.raises(error):
        break_lock("guard", **kwargs)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"token": 1.0}, TypeError), ({"token": -3}, ValueError),
        ({"owner": "f" * 31}, ValueError), ({"owner": None}, TypeError),
        ({"name": ""}, ValueError), ({"ttl": 0}, ValueError), ({"using": "nowhere"}, ValueError),
    ],
)
def test_hand_built_leases_are_checked(unchanged, fields, error):
    good = {"name": "guard", "owner": "a" * 32, "token": 1, "using": "default", "ttl": 5.0}
    with pytest.raises(error):
        Lease(**{**good, **fields})


def test_forged_owner_cannot_release_renew_or_break(unchanged):
    forged = Lease(
        "guard", "b" * 32, unchanged.token, using=unchanged.using, ttl=10,
        deadline=unchanged._deadline,
    )
    assert forged.release() is False
    forged = Lease("guard", "c" * 32, unchanged.token, using=unchanged.using, ttl=10)
    with pytest.raises(Exception, match="taken over"):
        forged.renew()
    assert break_lock("guard", owner="d" * 32) is False


@pytest.mark.parametrize(("age", "error"), BAD_AGES)
def test_bad_purge_ages(settings, age, error):
    settings.DISTLOCK_AUDIT = True
    acquire("idle", ttl=10).release()
    acquire("top", ttl=10).release()
    rows = list(Lock.objects.order_by("name").values())
    events = list(LockEvent.objects.order_by("id").values())
    with pytest.raises(error):
        purge_locks(idle=age)
    with pytest.raises(error):
        purge_events(older_than=age)
    assert list(Lock.objects.order_by("name").values()) == rows
    assert list(LockEvent.objects.order_by("id").values()) == events
    assert purge_locks(idle=0) == 2  # the same rows are purgeable by a good age


def test_bad_locked_templates(unchanged):
    with pytest.raises(TypeError):
        locked(5)
    with pytest.raises(ValueError):
        locked("report:{}")
    with pytest.raises(ValueError):
        locked("x", ttl=-1)
