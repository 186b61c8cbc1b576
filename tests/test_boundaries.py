"""S12: the instant a lease expires, with the database clock pinned to the microsecond.

One half-open definition must hold everywhere: a lease is valid while ``now < expires``
and may be taken over once ``now >= expires``, so there is no instant at which both the
old holder's fenced write and a new grant are allowed. The database clock expression
(the backend's ``now_sql()``) is replaced in this process by a literal, and every operation
is tried at ``expires - 1 µs`` and at ``expires``.

On PostgreSQL acquire, renew and release are server-side functions that read
``clock_timestamp()`` themselves, and so is the one-statement fenced write's check
(``distlock_holds``, migration 0002; its strict ``expires_us >`` is asserted in
test_fencing). There only the fenced write inside ``atomic()`` (the ownership check as SQL
built in Python) can be pinned, so the take-over half runs on SQLite only. The same holds
on MariaDB, whose acquire and renew are stored procedures (migration 0003); its folded
check is SQL built in Python (pinnable).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from django.db import connections, transaction
from django.db.models import F

from distlock import LockLost, acquire
from distlock.backends import backend_for
from distlock.exceptions import StaleToken
from distlock.models import Lock
from tests.stressapp.models import Resource

pytestmark = pytest.mark.usefixtures("lock_db")


class Clock:
    """The database clock as distlock's SQL sees it: real, or pinned to ``us``."""

    def __init__(self) -> None:
        self.us: int | None = None


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    pinned = Clock()
    backend = backend_for(connections["default"])
    real = backend.now_sql

    def now_sql():
        return real() if pinned.us is None else str(pinned.us)

    monkeypatch.setattr(backend, "now_sql", now_sql)
    yield pinned


def server_side() -> bool:
    """Do acquire and renew read the clock on the server (functions, procedures)?"""
    return connections["default"].vendor in ("postgresql", "mysql")


def write(lease) -> int:
    # Inside atomic() on PostgreSQL: the check is then SQL built in Python (pinnable). On
    # MariaDB the folded check is built in Python from now_sql() too.
    postgresql = connections["default"].vendor == "postgresql"
    with transaction.atomic() if postgresql else contextlib.nullcontext():
        return Resource.objects.filter(name=lease.name).fenced_update(
            lease, value=F("value") + 1
        )


def test_the_fenced_write_is_allowed_until_the_last_microsecond_only(clock):
    lease = acquire("edge:write", ttl=30)
    Resource.objects.create(name="edge:write")
    expires = Lock.objects.get(name="edge:write").expires_us

    clock.us = expires - 1
    assert write(lease) == 1, "refused while the lease was still valid"
    clock.us = expires
    with pytest.raises(StaleToken):
        write(lease)
    clock.us = None
    assert Resource.objects.get(name="edge:write").value == 1


@pytest.mark.skipif("server_side()", reason="acquire reads the server's own clock")
def test_take_over_is_refused_until_expiry_and_granted_at_it(clock):
    lease = acquire("edge:take", ttl=30)
    expires = Lock.objects.get(name="edge:take").expires_us

    clock.us = expires - 1
    assert acquire("edge:take", ttl=5, blocking=False) is None, "taken over a live lease"
    lease.renew(ttl=30)  # valid: renews to the pinned instant + 30 s
    renewed = Lock.objects.get(name="edge:take")
    assert renewed.renewed_us == expires - 1 and renewed.expires_us == expires - 1 + 30_000_000

    expires = renewed.expires_us
    clock.us = expires
    taker = acquire("edge:take", ttl=5, blocking=False)
    assert taker is not None and taker.token == lease.token + 1
    row = Lock.objects.get(name="edge:take")
    assert row.acquired_us == expires, "the grant must start where the old lease ended"
    with pytest.raises(LockLost):
        lease.renew()


@pytest.mark.skipif("server_side()", reason="renew reads the server's own clock")
def test_renewal_at_the_expiry_instant_is_refused(clock):
    lease = acquire("edge:renew", ttl=30)
    expires = Lock.objects.get(name="edge:renew").expires_us
    clock.us = expires
    with pytest.raises(LockLost, match="expired"):
        lease.renew()
    clock.us = None
    assert Lock.objects.get(name="edge:renew").expires_us == expires
