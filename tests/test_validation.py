"""Bad input (DESIGN invariant 9): a clear exception, and the lock table unchanged."""

from __future__ import annotations

import math
from datetime import timedelta
from decimal import Decimal

import pytest

from distlock import Lease, acquire, break_lock, lock, locked, purge_locks
from distlock.models import Lock, LockEvent

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
]
BAD_TIMEOUTS = [
    (-1, ValueError), (math.nan, ValueError), (math.inf, ValueError), (True, TypeError),
    ("10", TypeError), (timedelta(seconds=-5), ValueError),
]


@pytest.mark.parametrize(("name", "error"), BAD_NAMES)
def test_bad_names(unchanged, name, error):
    with pytest.raises(error):
        acquire(name, ttl=10)
    with pytest.raises(error):
        lock(name)
    with pytest.raises(error):
        break_lock(name)


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


def test_bad_purge_idle(unchanged):
    with pytest.raises(ValueError):
        purge_locks(idle=-1)
    with pytest.raises(TypeError):
        purge_locks(idle="1 day")


def test_bad_locked_templates(unchanged):
    with pytest.raises(TypeError):
        locked(5)
    with pytest.raises(ValueError):
        locked("report:{}")
    with pytest.raises(ValueError):
        locked("x", ttl=-1)
