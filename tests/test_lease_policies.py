"""Lease policies (docs/lease-policies.md): min_hold, max_hold and lock_delay, each judged
by the database clock, on every backend. Waits are for the database clock to pass a moment
the database itself wrote (``past``), never sleeps."""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest
from django.db import connections, transaction

from distlock import (
    LockLost,
    StaleToken,
    TransactionNotAllowed,
    aacquire,
    acquire,
    alock,
    break_lock,
    lock,
    locked,
)
from distlock.backends.results import RENEW_REFUSED
from distlock.checks import check_settings
from distlock.core.policies import DELAY_OWNER, MAX_HOLD_REFUSED, named
from distlock.db import db_now_us
from distlock.models import Lock
from distlock.testing import make_stale
from tests.factories import AccountFactory
from tests.support.helpers import run_async, us, wait_until

pytestmark = pytest.mark.usefixtures("lock_db")

WORKERS = "tests.support.policy_workers"


def past(moment_us: int, alias: str = "default", timeout: float = 20.0) -> None:
    """Wait until the database clock is at or past ``moment_us``."""
    wait_until(lambda: db_now_us(alias) >= moment_us, timeout,
               "the database clock to reach the moment", every=0.02)


def row(name: str) -> Lock:
    return Lock.objects.get(name=name)


# -- min_hold --------------------------------------------------------------------------


def test_a_release_before_min_hold_keeps_the_lock_until_then_and_not_longer():
    lease = acquire("mh:report", ttl=30, min_hold=1.5)
    assert lease.release() is True
    kept = row("mh:report")
    # Kept for the holder, same owner and token, ending at acquired + min_hold exactly.
    assert (kept.owner, kept.token) == (lease.owner, lease.token)
    assert kept.expires_us == kept.acquired_us + 1_500_000 == us(lease.released_at)
    assert lease.is_current()
    other = acquire("mh:report", ttl=30, blocking=False)
    if other is not None:  # only if this machine stalled past the hold
        assert us(other.acquired_at) >= kept.expires_us
        return
    past(kept.expires_us)
    # Not longer: the first try once the database clock has passed it gets the lock.
    after = acquire("mh:report", ttl=30, blocking=False)
    assert after is not None and after.token == lease.token + 1
    assert us(after.acquired_at) >= kept.expires_us
    assert not lease.is_current()


def test_a_release_after_min_hold_frees_at_once_and_a_release_of_a_lost_lease_keeps_nothing():
    lease = acquire("mh:late", ttl=30, min_hold=0.2)
    past(row("mh:late").acquired_us + 200_000)
    assert lease.release() is True
    assert row("mh:late").owner == ""
    assert acquire("mh:late", ttl=30, blocking=False) is not None
    # A lease broken before its release keeps nothing: the release is a no-op.
    gone = acquire("mh:broken", ttl=30, min_hold=10)
    assert break_lock("mh:broken") is True
    assert gone.release() is False
    assert row("mh:broken").owner == ""


def test_a_waiting_acquire_gets_the_lock_when_the_hold_ends():
    """Nobody is woken when a hold ends (it is no release): a waiter's pause ends with the
    holder's lease, as for any expiry."""
    lease = acquire("mh:wait", ttl=30, min_hold=1)
    assert lease.release() is True
    end = row("mh:wait").expires_us
    waited = acquire("mh:wait", ttl=30, timeout=20)
    assert waited is not None and us(waited.acquired_at) >= end


@pytest.mark.processes
def test_another_process_cannot_get_a_lock_kept_by_min_hold(children):
    child = children.start(f"{WORKERS}:try_once", "mh:proc")
    child.expect("ready", timeout=60)
    lease = acquire("mh:proc", ttl=30, min_hold=30)
    assert lease.release() is True
    child.send("go")
    assert child.expect("busy", timeout=30)
    assert (row("mh:proc").owner, row("mh:proc").token) == (lease.owner, lease.token)


def test_a_block_under_min_hold_and_a_fenced_write_in_the_hold():
    account = AccountFactory()
    with lock(account.get_fence_name(), ttl=30, min_hold=5) as lease:
        pass
    # Released, but the hold keeps the grant: its token still fences.
    account.note = "in the hold"
    account.save(fence=lease)
    assert row(account.get_fence_name()).owner == lease.owner


# -- max_hold --------------------------------------------------------------------------


def test_max_hold_caps_renewals_and_refuses_them_from_then_on_and_fences_after_it():
    account = AccountFactory()
    name = account.get_fence_name()
    lease = acquire(name, ttl=1.5, max_hold=1.5)
    start = row(name)
    try:
        lease.renew(ttl=30)
    except LockLost as exc:  # only if this machine stalled past the max_hold
        assert exc.reason == MAX_HOLD_REFUSED
    else:
        assert row(name).expires_us == start.acquired_us + 1_500_000
        assert lease.remaining() <= 1.5
    past(start.acquired_us + 1_500_000)
    with pytest.raises(LockLost) as lost:
        lease.renew(ttl=30)
    assert lost.value.reason == MAX_HOLD_REFUSED and lease.lost
    assert row(name).expires_us == start.acquired_us + 1_500_000
    account.note = "after max_hold"
    with pytest.raises(StaleToken):
        account.save(fence=lease)
    assert acquire(name, ttl=30, blocking=False) is not None


def test_auto_renew_stops_at_max_hold_and_reports_the_loss():
    lost = []
    lease = acquire("mx:auto", ttl=0.9, max_hold=1.8, auto_renew=True,
                    on_lost=lambda lease, exc: lost.append(exc))
    wait_until(lambda: lost, 30, "on_lost")
    assert lease.lost
    done = row("mx:auto")
    assert done.expires_us <= done.acquired_us + 1_800_000
    assert acquire("mx:auto", ttl=30, blocking=False) is not None


# -- lock_delay ------------------------------------------------------------------------


@pytest.mark.processes
def test_a_killed_holders_lock_waits_out_its_lock_delay_after_the_lease(children):
    holder = children.start(f"{WORKERS}:hold_with_delay", "ld:killed", 0.5, 1.5)
    got = holder.expect("acquired", timeout=60)
    holder.signal(signal.SIGKILL)
    held = row("ld:killed")
    # The row ends lock_delay after the holder's lease.
    assert got["expires_us"] == held.acquired_us + 500_000
    assert held.expires_us == got["expires_us"] + 1_500_000
    assert held.holder.startswith("[lock_delay=1.5s] ")
    past(got["expires_us"])
    early = acquire("ld:killed", ttl=30, blocking=False)
    if early is not None:  # only if this machine stalled past the delay
        assert us(early.acquired_at) >= held.expires_us
        return
    taken = acquire("ld:killed", ttl=30, timeout=30)
    assert taken is not None and taken.token == got["token"] + 1
    assert us(taken.acquired_at) >= got["expires_us"] + 1_500_000


def test_lock_delay_after_an_expiry_and_not_after_a_release():
    lease = acquire("ld:expiry", ttl=0.3, lock_delay=1)
    end = us(lease.expires_at)
    # The holder's lease is its ttl; the row ends lock_delay after it.
    assert end == row("ld:expiry").acquired_us + 300_000
    assert row("ld:expiry").expires_us == end + 1_000_000
    past(end)
    early = acquire("ld:expiry", ttl=30, blocking=False)
    assert early is None or us(early.acquired_at) >= end + 1_000_000
    past(end + 1_000_000)
    if early is None:
        assert acquire("ld:expiry", ttl=30, blocking=False) is not None
    # A release is no loss: the name is free at once.
    clean = acquire("ld:release", ttl=30, lock_delay=30)
    assert clean.release() is True
    assert acquire("ld:release", ttl=30, blocking=False) is not None


def test_a_renewal_keeps_the_lock_delay_on_the_row():
    lease = acquire("ld:renew", ttl=30, lock_delay=2)
    lease.renew(ttl=10)
    renewed = row("ld:renew")
    assert renewed.expires_us == us(lease.expires_at) + 2_000_000
    assert renewed.expires_us - renewed.renewed_us == 12_000_000


def test_a_break_starts_the_lock_delay_and_a_second_break_ends_it():
    account = AccountFactory()
    name = account.get_fence_name()
    lease = acquire(name, ttl=30, lock_delay=1.5)
    assert break_lock(name, by="ops") is True
    delayed = row(name)
    assert delayed.owner == DELAY_OWNER and delayed.token == lease.token
    assert named(delayed.holder) == {"lock_delay": 1.5}
    # The broken holder is out at once: renewal and fenced writes fail.
    with pytest.raises(LockLost):
        lease.renew()
    with pytest.raises(StaleToken):
        account.save(fence=lease)
    early = acquire(name, ttl=30, blocking=False)
    if early is None:
        past(delayed.expires_us)
        after = acquire(name, ttl=30, blocking=False)
        assert after is not None and after.token == lease.token + 1
        assert us(after.acquired_at) >= delayed.expires_us
        after.release()
    else:  # only if this machine stalled past the delay
        assert us(early.acquired_at) >= delayed.expires_us
        early.release()
    # An operator ends a lock-delay early with a second break.
    again = acquire(name, ttl=30, lock_delay=60)
    assert break_lock(name) is True and row(name).owner == DELAY_OWNER
    assert break_lock(name) is True and row(name).owner == ""
    assert acquire(name, ttl=30, blocking=False).token == again.token + 1


# -- naming, settings, bad input -------------------------------------------------------


def test_a_renewal_under_max_hold_keeps_the_lock_delay_on_the_row():
    """max_hold's renewal (its own statement) ends the row lock_delay after the lease too."""
    lease = acquire("ld:capped", ttl=30, max_hold=60, lock_delay=2)
    lease.renew(ttl=10)
    renewed = row("ld:capped")
    assert renewed.expires_us == us(lease.expires_at) + 2_000_000
    # This statement reads the clock once per expression: µs apart, not exactly equal.
    assert 0 <= renewed.expires_us - renewed.renewed_us - 12_000_000 < 1_000


def test_max_hold_refuses_a_renewal_during_the_lock_delay_after_it():
    """Past acquired + max_hold the row still counts as held (its lock-delay), and the
    holder's renewal is refused all the same: the lease ended at max_hold."""
    lease = acquire("ld:max", ttl=1, max_hold=1, lock_delay=30)
    acquired = row("ld:max").acquired_us
    past(acquired + 1_000_000)
    with pytest.raises(LockLost) as lost:
        lease.renew(ttl=1)
    assert lost.value.reason == MAX_HOLD_REFUSED
    assert row("ld:max").expires_us == acquired + 31_000_000  # the delay, unchanged


def test_a_renewal_under_max_hold_of_a_grant_taken_over_says_it_changed():
    lease = acquire("mx:over", ttl=30, max_hold=60)
    make_stale(lease)
    other = acquire("mx:over", ttl=30, blocking=False)
    assert other is not None
    with pytest.raises(LockLost) as lost:
        lease.renew(ttl=30)
    assert lost.value.reason == RENEW_REFUSED["changed"]
    assert (row("mx:over").owner, row("mx:over").token) == (other.owner, other.token)


def test_a_release_under_min_hold_of_an_ended_lease_keeps_nothing():
    """A lease that ended (here made stale: its row expired now) before its min_hold is
    not brought back by its release: the row stays free to take."""
    lease = acquire("mh:ended", ttl=30, min_hold=20)
    make_stale(lease)
    assert lease.release() is False
    assert row("mh:ended").expires_us <= db_now_us("default")
    assert acquire("mh:ended", ttl=30, blocking=False) is not None


def test_the_holder_text_keeps_each_policy_to_the_microsecond():
    lease = acquire("pn:exact", ttl=30, min_hold=1.234567, lock_delay=0.000123)
    assert named(lease.holder) == {"min_hold": 1.234567, "lock_delay": 0.000123}
    assert lease.release() is True


def test_the_holder_text_names_the_policies_before_the_callers_text():
    lease = acquire("pn:named", ttl=30, min_hold=5, lock_delay=timedelta(seconds=2),
                    holder="nightly")
    assert lease.holder.startswith("[min_hold=5s lock_delay=2s] ")
    assert lease.holder.endswith(" nightly")
    assert row("pn:named").holder == lease.holder
    assert named(lease.holder) == {"min_hold": 5.0, "lock_delay": 2.0}
    assert lease.policies is not None and lease.policies.max_hold is None
    plain = acquire("pn:plain", ttl=30, holder="[min_hold=5s] not mine")
    assert plain.policies is None and named(plain.holder) == {}


def test_settings_give_the_defaults_and_none_turns_one_off(settings):
    settings.DISTLOCK_MIN_HOLD = 2
    settings.DISTLOCK_LOCK_DELAY = 0.5
    lease = acquire("ps:default", ttl=30)
    assert lease.holder.startswith("[min_hold=2s lock_delay=0.5s] ")
    lease.release()
    assert row("ps:default").owner == lease.owner  # kept by the setting's min_hold
    off = acquire("ps:off", ttl=30, min_hold=None, lock_delay=None)
    assert off.policies is None
    off.release()
    assert row("ps:off").owner == ""
    settings.DISTLOCK_MIN_HOLD = -1
    settings.DISTLOCK_MAX_HOLD = "60"
    assert {e.id for e in check_settings()} == {"distlock.E005"}
    assert len(check_settings()) == 2


@pytest.mark.parametrize(("options", "error"), [
    ({"min_hold": -1}, ValueError),
    ({"min_hold": 0}, ValueError),
    ({"max_hold": "10"}, TypeError),
    ({"lock_delay": float("nan")}, ValueError),
    ({"lock_delay": 10**9}, ValueError),
    ({"min_hold": 31}, ValueError),  # longer than the ttl
    ({"max_hold": 29}, ValueError),  # shorter than the ttl
])
def test_bad_policies_raise_before_anything_is_written(options, error):
    with pytest.raises(error):
        acquire("pb:bad", ttl=30, **options)
    with pytest.raises(error):
        lock("pb:bad", ttl=30, **options)
    with pytest.raises(error):
        locked("pb:{x}", ttl=30, **options)
    assert not Lock.objects.filter(name="pb:bad").exists()


def test_inside_the_callers_atomic_as_acquire_is():
    with transaction.atomic(), pytest.raises(TransactionNotAllowed):
        acquire("pa:atomic", ttl=30, min_hold=5, lock_delay=1)
    assert not Lock.objects.filter(name="pa:atomic").exists()
    lease = acquire("pa:atomic", ttl=30, min_hold=5)
    expires = row("pa:atomic").expires_us
    with transaction.atomic(), pytest.raises(TransactionNotAllowed):
        lease.release()
    assert row("pa:atomic").expires_us == expires  # nothing changed
    assert lease.release() is True


@pytest.mark.django_db(transaction=True, databases=["default", "locks"])
def test_a_release_deferred_by_fenced_writes_still_keeps_min_hold(settings):
    if connections["default"].vendor == "sqlite":
        pytest.skip("one writer per SQLite file: no lock alias inside atomic()")
    settings.DISTLOCK_DATABASE = "locks"
    account = AccountFactory()
    name = account.get_fence_name()
    with transaction.atomic():
        lease = acquire(name, ttl=30, min_hold=30)
        account.note = "fenced"
        account.save(fence=lease)
        assert lease.release() is True  # deferred to the commit
    kept = row(name)
    assert (kept.owner, kept.expires_us) == (lease.owner, kept.acquired_us + 30_000_000)


def test_async_policies():
    async def main() -> tuple[Lock, str, Lock, Lock]:
        lease = await aacquire("pz:async", ttl=30, min_hold=20, lock_delay=1)
        assert await lease.arelease() is True
        kept = await Lock.objects.aget(name="pz:async")
        assert await aacquire("pz:async", ttl=30, blocking=False) is None
        async with alock("pz:block", ttl=30, max_hold=40, timeout=5) as block:
            await block.arenew(ttl=60)
            capped = await Lock.objects.aget(name="pz:block")
        freed = await Lock.objects.aget(name="pz:block")
        return kept, lease.owner, capped, freed

    kept, owner, capped, freed = run_async(main)
    assert kept.owner == owner and kept.expires_us == kept.acquired_us + 20_000_000
    assert capped.expires_us == capped.acquired_us + 40_000_000
    assert freed.owner == ""  # the block's end freed it (no min_hold)


def test_a_decorated_call_gets_the_policies():
    @locked("pd:{job}", ttl=30, min_hold=10)
    def run(job: str) -> str:
        from distlock import current_lease

        lease = current_lease()
        assert lease is not None
        return lease.owner

    owner = run("x")
    assert row("pd:x").owner == owner


def test_no_policy_costs_no_holder_prefix_and_no_delay():
    lease = acquire("pp:plain", ttl=30)
    assert lease.policies is None and not lease.holder.startswith("[")
    assert row("pp:plain").expires_us == us(lease.expires_at)


def test_leaders_and_periodic_jobs_take_no_policy_from_the_settings(settings):
    from distlock import current_lease
    from distlock.leader import elect
    from distlock.periodic import periodic_once

    settings.DISTLOCK_MAX_HOLD = 1  # shorter than their ttls: would raise if applied
    settings.DISTLOCK_LOCK_DELAY = 5
    term = elect("pl:leader", ttl=30)
    assert term is not None and term.lease.policies is None
    assert term.resign() is True
    assert row("pl:leader").owner == ""  # freed at once: no delay

    @periodic_once("pl:job", every=60)
    def job() -> str:
        lease = current_lease()
        assert lease is not None and lease.policies is None
        return "ran"

    assert job() == "ran"
