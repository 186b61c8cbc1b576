"""A grant is its (owner, token) pair, and its lease ends by the database clock.

Release and renew must match both halves of the pair: the real owner with a neighbouring
token (the grant before or after it) is a different grant. A lease that ran out and that
nobody took over is over: it cannot be renewed back to life, and a lease with less than a
second left is still held.
"""

from __future__ import annotations

import pytest

from distlock import LockLost, acquire
from distlock.core.leases import Lease
from distlock.db import run
from distlock.models import Lock
from tests.support.helpers import expired_lock, us

pytestmark = pytest.mark.usefixtures("lock_db")


def snapshot(name: str) -> tuple[object, ...]:
    row = Lock.objects.get(name=name)
    return (row.token, row.owner, row.holder, row.acquired_us, row.renewed_us,
            row.expires_us, row.renew_count)


@pytest.fixture
def held() -> Lease:
    """A held lease whose token has a neighbour on each side (token 2 or more)."""
    acquire("pair", ttl=60).release()
    lease = acquire("pair", ttl=60, holder="real")
    assert lease is not None and lease.token >= 2
    return lease


@pytest.mark.parametrize("change", [-1, +1], ids=["token-1", "token+1"])
def test_the_real_owner_with_another_token_cannot_release_or_renew(held, change):
    before = snapshot("pair")
    forged = Lease("pair", held.owner, held.token + change, using=held.using, ttl=60)
    assert forged.release() is False
    assert snapshot("pair") == before, "a release with the wrong token changed the row"
    forged = Lease("pair", held.owner, held.token + change, using=held.using, ttl=60)
    with pytest.raises(LockLost, match="released, broken or taken over"):
        forged.renew()
    assert forged.lost
    assert snapshot("pair") == before, "a renewal with the wrong token changed the row"
    assert run(held.using, "holds", "pair", held.owner, held.token) is True
    assert held.release() is True


def test_the_real_token_with_another_owner_cannot_release_or_renew(held):
    before = snapshot("pair")
    other = "0" * 32 if held.owner != "0" * 32 else "1" * 32
    assert Lease("pair", other, held.token, using=held.using, ttl=60).release() is False
    with pytest.raises(LockLost):
        Lease("pair", other, held.token, using=held.using, ttl=60).renew()
    assert snapshot("pair") == before
    assert held.release() is True


def test_an_expired_lease_nobody_took_over_cannot_be_renewed():
    lease = expired_lock("lapsed")
    before = snapshot("lapsed")
    assert before[1] == lease.owner, "still the lapsed lease's row (nobody took it over)"
    with pytest.raises(LockLost, match="expired"):
        lease.renew(ttl=60)
    assert lease.lost and lease.remaining() == 0
    assert snapshot("lapsed") == before, "the refused renewal changed the row"
    # Refused for good: a second try, with the default ttl, fails the same way.
    with pytest.raises(LockLost):
        lease.renew()
    taker = acquire("lapsed", ttl=30, blocking=False)
    assert taker is not None and taker.token == lease.token + 1
    assert taker.release() is True


def test_a_lease_with_under_a_second_left_is_not_taken_over():
    holding = acquire("short", ttl=0.8, holder="short")
    expires = Lock.objects.get(name="short").expires_us
    taker = acquire("short", ttl=5, blocking=False)
    if taker is not None:
        # Only right if this machine stalled for the whole 0.8 s before the try.
        assert us(taker.acquired_at) >= expires, "taken over a live lease"
        taker.release()
        return
    assert Lock.objects.get(name="short").owner == holding.owner
    holding.release()
