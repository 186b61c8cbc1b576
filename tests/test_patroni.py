"""Faults of a Patroni-managed PostgreSQL under load, judged by the history checker.

tests/support/patroni.py runs three etcd members and Patroni managing three PostgreSQL 15
members (asynchronous streaming replication, ttl 20 s, loop_wait 2 s); Django reaches the
leader through a libpq host list with ``target_session_attrs=read-write``. Four worker
processes (tests/support/stress_workers.py) contend for two locks: acquire, read, hold,
fenced write with its ground-truth row, release. Then one fault, with no operator step:

* the leader's Patroni and every process of its PostgreSQL SIGKILLed (a machine lost):
  after the ttl a standby is promoted;
* the same with the leader's WAL senders SIGSTOPped first, so the standbys miss the last
  acknowledged grants (replication lag made certain): they are lost, and the timeline
  follow keeps their tokens from being issued again;
* a switchover through Patroni's REST API (what ``patronictl switchover`` asks for);
* one etcd member SIGKILLed: no failover, the locks go on;
* Patroni's ``synchronous_mode`` on (``synchronous_mode_strict`` off, docs/deployment.md
  says why), the leader killed: the synchronous standby is promoted, nothing acknowledged
  is lost;
* ``synchronous_mode`` on, the leader's WAL senders SIGSTOPped: every commit now waits for
  the standby and none is acknowledged; the waits are cancelled (``pg_cancel_backend``),
  so PostgreSQL reports those commits done with a WARNING — distlock raises NotReplicated
  for them (the workers record them as not granted / indeterminate) — then more commits
  wait, and the leader is killed: those are indeterminate (the connection breaks). No
  acknowledged grant or write is lost and no token is issued again.

* the leader partitioned from etcd alone (its own cluster: pg0 in a network namespace
  whose link to etcd is cut, while clients and standbys still reach it), asynchronous and
  in ``synchronous_mode``: its Patroni demotes it when it cannot renew the leader key
  (``retry_timeout``), before the key's ``ttl`` lets another member be promoted; no
  violation, no token issued again.

* the leader's whole member SIGSTOPped until another member takes writes, then resumed
  (its PostgreSQL first, its Patroni once the old primary has shown what it does):
  asynchronous without a watchdog, the control — the resumed old primary acknowledges
  grants and fenced writes beside the new leader, lost with its timeline (Debian's
  Patroni 3.0.2 may even take the leader key back: the test kills it after 90 s);
  ``synchronous_mode`` without a watchdog — its commits wait, nothing is acknowledged
  there (when Patroni demotes it); and with Patroni's watchdog (``mode: required``,
  ``driver: testing`` on a named pipe emulated by tests/support/watchdog.py) — the
  member is reset (SIGKILLed) before the new leader is promoted, nothing to resume.

CI runs the synchronous cancelled-wait fault; the plain synchronous kill, the etcd
partition and the paused leader run with ``DISTLOCK_HA_FULL=1`` (the closing figures'
runs; ``scripts/ha`` documents the command).

Each prints its summary (-rA): grants, writes, refusals, indeterminate outcomes, violations,
tokens issued again, the longest time no grant was acknowledged. Runs in the PostgreSQL
pass (slow); one cluster for the module, brought back to three streaming members before
each test (a killed member comes back as a fresh clone).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.stress import checker
from tests.stress.harness import HISTORY, Profile, read_histories, trigger_statements
from tests.support.failover import (
    Analysis,
    Outcome,
    analyse,
    contending,
    lost,
    seed,
    tables,
    told_not_replicated,
    wait_for_grants,
)
from tests.support.helpers import wait_until
from tests.support.namespaces import need_netns
from tests.support.patroni import TTL, Isolation, Member, Patroni
from tests.support.pg_clusters import now_us
from tests.support.watchdog import Watchdog

pytestmark = [
    pytest.mark.slow,
    pytest.mark.processes,
    pytest.mark.no_pooler("runs its own PostgreSQL servers: no pooler is in the way"),
]

if not (
    os.environ.get("DISTLOCK_TEST_BACKEND") == "postgresql"
    or os.environ.get("DISTLOCK_TEST_FAULTS") == "1"
):
    pytest.skip(
        "Patroni tests run in the PostgreSQL pass (DISTLOCK_TEST_BACKEND=postgresql) or "
        "with DISTLOCK_TEST_FAULTS=1",
        allow_module_level=True,
    )

FULL = os.environ.get("DISTLOCK_HA_FULL") == "1"
full_only = pytest.mark.skipif(
    not FULL, reason="one of the full HA set (DISTLOCK_HA_FULL=1): CI runs one synchronous fault",
)

VOLUME = checker.Volume(grants=10, writes=5, stale_refused=0)
# Grants of each lock to see before the fault and after it (the new leader's).
BEFORE, AFTER = 6, 6
DEADLINE = 90.0
#: The watchdog's ``safety_margin``: its device resets ttl - 5 = 15 s after the last keepalive.
WATCHDOG_MARGIN = 5


def profile(prefix: str) -> Profile:
    return Profile(workers=4, locks=2, ttl=0.5, fault_seconds=90.0, skewed_clocks=False,
                   prefix=prefix)


@contextlib.contextmanager
def running(ha: Patroni) -> Iterator[Member]:
    """``ha`` started, its leader given the history's triggers; stopped by PID after,
    whatever happened. Yields the leader."""
    try:
        ha.start()
        leader = ha.wait_leader(60)
        for statement in trigger_statements("postgresql"):
            leader.query(statement)
        yield leader
    finally:
        ha.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Patroni]:
    ha = Patroni()
    with running(ha):
        yield ha


def ready(cluster: Patroni, synchronous: bool) -> Patroni:
    """Three streaming members again, with the replication mode the test asks for."""
    cluster.restore()
    if cluster.synchronous() != synchronous:
        cluster.set_synchronous(synchronous)
    else:
        # After a failover the new leader names its synchronous standby anew.
        cluster.wait_synchronous(synchronous)
    return cluster


@pytest.fixture
def ha(cluster: Patroni) -> Patroni:
    return ready(cluster, synchronous=False)


@pytest.fixture
def ha_sync(cluster: Patroni) -> Patroni:
    return ready(cluster, synchronous=True)


def run(ha: Patroni, directory: Path, prefix: str, fault: str,
        seen: dict[str, Any] | None = None) -> Outcome:
    """Contend, make the fault, wait for grants by the leader after it, stop. ``seen``
    gets what a paused leader's run measured (:func:`pause`)."""
    names = profile(prefix).names()
    leader = ha.wait_leader(60)
    leader.query(f"TRUNCATE {HISTORY}, stressapp_write")
    leader.query("DELETE FROM stressapp_resource")
    seed(leader.query, names)
    with contending(profile(prefix), directory, ha.env()) as workers:
        wait_for_grants(directory, names, 0, BEFORE, f"{BEFORE} grants of each lock",
                        deadline=DEADLINE)
        cut_us = fault_us = now_us()
        if fault in ("kill", "kill-lagging"):
            if fault == "kill-lagging":
                stop_wal_senders(leader)
                cut_us = now_us()
                if ha.synchronous():
                    cancel_synchronous_waits(leader, directory)
                else:
                    wait_for_grants(directory, names, cut_us, 3,
                                    "3 grants of each lock the standbys lack",
                                    deadline=DEADLINE)
            fault_us = now_us()
            ha.kill_member(leader)
            ha.kill_server(leader)
            after = ha.wait_leader(DEADLINE, other_than=leader)
        elif fault == "partition":
            assert ha.isolated is not None and leader is ha.members[0]
            ha.isolated.dcs.cut()
            demoted = wait_until(lambda: not writable(leader) and now_us(), DEADLINE,
                                 "the partitioned leader to stop taking writes", every=0.1)
            after = ha.wait_leader(DEADLINE, other_than=leader)
            promoted = now_us()
            print(f"\npartitioned leader no longer writable {(demoted - fault_us) / 1e6:.1f} s "
                  f"after the cut, the new leader seen writable "
                  f"{(promoted - fault_us) / 1e6:.1f} s after it")
            assert demoted < promoted
        elif fault == "pause":
            seen = {} if seen is None else seen
            after, fault_us = pause(ha, leader, directory, names, seen)
            wait_for_grants(directory, names, seen["ended_us"], AFTER,
                            f"{AFTER} grants of each lock after the old primary's demotion",
                            deadline=DEADLINE)
        elif fault == "switchover":
            ha.switchover(leader)
            after = ha.wait_leader(DEADLINE, other_than=leader)
        else:
            ha.etcd.kill(0)
            after = leader
        wait_for_grants(directory, names, fault_us, AFTER,
                        f"{AFTER} grants of each lock after the fault", deadline=DEADLINE)
        if fault == "etcd":
            assert ha.leader() is leader, "an etcd member's loss changed the leader"
        workers.stop(grace=30)
        return outcome(after, directory, fault, cut_us, fault_us)


def writable_other(ha: Patroni, leader: Member) -> Member | None:
    """A member other than ``leader`` that takes writes (asked directly, not through
    Patroni's REST API, which a stopped leader would keep waiting)."""
    for member in ha.members:
        if member is not leader and member.process is not None and writable(member):
            return member
    return None


def pause(ha: Patroni, leader: Member, directory: Path, names: list[str],
          seen: dict[str, Any]) -> tuple[Member, int]:
    """Stop the leader's machine (its Patroni and every process of its PostgreSQL:
    SIGSTOP) until another member takes writes, then resume it: its PostgreSQL first, and
    its Patroni only once the old primary has shown what it does meanwhile — a grant and a
    fenced write acknowledged there (asynchronous), or a commit waiting for the
    synchronous standby that was promoted (``synchronous_mode``). The order makes the
    window certain rather than a race with Patroni's first loop. ``seen`` gets the times
    (µs, this host's clock, which the servers read too), the emulated watchdog resets, and
    ``before``: the client events recorded before the resume (every later one was answered
    by the resumed old primary or, once it is gone, the new leader). Returns the new
    leader and the time of the pause."""
    synchronous = ha.synchronous()
    paused = seen["paused_us"] = now_us()
    ha.freeze(leader)
    after = wait_until(lambda: writable_other(ha, leader), DEADLINE,
                       "another member taking writes", every=0.1)
    seen["promoted_us"] = now_us()
    # The emulated resets (µs): the old leader's, and any other member's (none expected).
    seen["resets"] = [int(t * 1e6) for name, w in ha.watchdogs.items()
                      if name == leader.name for t in w.resets]
    seen["other_resets"] = [t for name, w in ha.watchdogs.items()
                            if name != leader.name for t in w.resets]
    before = {json.dumps(event, sort_keys=True) for event in read_histories(directory)}
    seen["resumed_us"] = resumed = now_us()
    for pid in leader.server_pids():
        # A backend that was exiting when the machine stopped may be gone by now.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    def new_events() -> list[dict[str, Any]]:
        return [event for event in read_histories(directory)
                if json.dumps(event, sort_keys=True) not in before]

    if ha.watchdogs:
        # Reset: nothing is left of the machine to resume.
        seen["old_writable"] = writable(leader)
    elif synchronous:
        seen["waiting"] = len(wait_until(lambda: waiting_for_standby(leader), DEADLINE,
                                         "a commit on the old primary waiting", every=0.05))
    else:
        def acknowledged_there() -> bool:
            # Every client was on the old primary (stopped mid-call): what is answered now,
            # with the new leader writable, the old primary answered.
            events = new_events()
            seen["old_grants"] = sum(e["type"] == "acquire" and e["status"] == "ok"
                                     and e["acquired_us"] > resumed for e in events)
            seen["old_writes"] = sum(e["type"] == "write" and e["status"] == "ok"
                                     for e in events)
            return bool(seen["old_grants"] and seen["old_writes"])

        wait_until(acknowledged_there, DEADLINE,
                   "a grant and a fenced write acknowledged by the resumed old primary",
                   every=0.05)
    seen["patroni_resumed_us"] = now_us()
    ha.signal_member(leader, signal.SIGCONT)
    seen["demoted_us"] = None
    with contextlib.suppress(AssertionError):
        seen["demoted_us"] = wait_until(lambda: not writable(leader) and now_us(), DEADLINE,
                                        "the old primary to stop taking writes", every=0.05)
    if seen["demoted_us"] is None:
        # Patroni's own account of why (its last lines), for the run's report.
        log = (leader.dir / "patroni.log").read_text(errors="replace").splitlines()
        dated = [line for line in log if line.startswith("20")]
        print("\nold leader never demoted; its Patroni's last lines:\n  "
              + "\n  ".join(dated[-4:]))
    seen["before"] = before
    # A fresh clone of the leader replaces it at the next test (restore()).
    ha.kill_member(leader)
    ha.kill_server(leader)
    # Never demoted (Patroni took the key back): its end as a primary is the kill.
    seen["ended_us"] = seen["demoted_us"] or now_us()
    # When Patroni took the key back, the member first promoted was demoted by it, and
    # another may lead after the kill: the run's tables are the final leader's.
    final = ha.wait_leader(DEADLINE, other_than=leader)
    seen["first_promoted_kept"] = final is after
    if seen["demoted_us"] is None or final is not after:
        # Patroni took the key back: the others may have followed either timeline (one
        # then never streams from the final leader). Fresh clones replace them.
        for member in ha.members:
            if member is not final:
                ha.kill_member(member)
                ha.kill_server(member)
    return final, paused


def stop_wal_senders(leader: Member) -> None:
    """SIGSTOP the leader's WAL senders: the standbys receive nothing more (stopping the
    receivers would not do: what the sender wrote waits in the socket for them)."""
    pids = [pid for (pid,) in leader.query("SELECT pid FROM pg_stat_replication",
                                           dbname="postgres")]
    assert pids, "no WAL sender on the leader"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def writable(member: Member) -> bool:
    try:
        return not member.query("SELECT pg_is_in_recovery()", dbname="postgres")[0][0]
    except Exception:  # noqa: BLE001 - stopped or restarting: not taking writes
        return False


def waiting_for_standby(leader: Member) -> list[int]:
    """The leader's backends whose COMMIT waits for the synchronous standby."""
    return [pid for (pid,) in leader.query(
        "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'", dbname="postgres")]


def cancel_synchronous_waits(leader: Member, directory: Path) -> None:
    """With the standbys cut off: cancel the commits waiting for them until a worker got
    NotReplicated (PostgreSQL reported such a commit done, with a WARNING), then wait
    until commits wait again, so the kill leaves some indeterminate too."""
    def cancelled() -> bool:
        for pid in waiting_for_standby(leader):
            leader.query("SELECT pg_cancel_backend(%s)", [pid], dbname="postgres")
        return any(map(told_not_replicated, read_histories(directory)))

    wait_until(cancelled, DEADLINE, "a worker told NotReplicated", every=0.2)
    wait_until(lambda: len(waiting_for_standby(leader)) > 0, DEADLINE,
               "a commit waiting for the stopped standbys again", every=0.05)


def outcome(leader: Member, directory: Path, label: str, cut_us: int,
            fault_us: int) -> Outcome:
    return Outcome(
        label=f"patroni: {label}", client=read_histories(directory), **tables(leader.rows),
        # Every grant from the fault on counts as after it (a switchover's old leader
        # grants until it is demoted): each must be above every one before.
        cut_us=cut_us, dead_us=fault_us, promote_us=fault_us,
    )


def judged(result: Outcome, prefix: str) -> Analysis:
    analysis = analyse(result, profile(prefix).names(), VOLUME)
    print("\n" + analysis.summary(result))
    assert analysis.report.ok, analysis.report.describe()
    assert analysis.reissued == 0
    assert all(analysis.max_before[n] < analysis.min_after[n] for n in profile(prefix).names())
    return analysis


def test_leader_killed(ha, tmp_path):
    judged(run(ha, tmp_path, "patroni-kill", "kill"), "patroni-kill")


def test_leader_killed_with_its_standbys_behind_loses_grants_but_issues_none_again(ha, tmp_path):
    analysis = judged(run(ha, tmp_path, "patroni-lag", "kill-lagging"), "patroni-lag")
    assert analysis.lost_grants > 0, "the standbys received every grant"


def test_switchover(ha, tmp_path):
    analysis = judged(run(ha, tmp_path, "patroni-switch", "switchover"), "patroni-switch")
    assert analysis.lost_grants == analysis.lost_writes == 0


def test_an_etcd_member_killed(ha, tmp_path):
    analysis = judged(run(ha, tmp_path, "patroni-etcd", "etcd"), "patroni-etcd")
    assert analysis.lost_grants == analysis.lost_writes == 0


@full_only
def test_synchronous_mode_leader_killed_loses_nothing_acknowledged(ha_sync, tmp_path):
    analysis = judged(run(ha_sync, tmp_path, "patroni-sync-kill", "kill"), "patroni-sync-kill")
    assert (analysis.lost_grants, analysis.lost_renewals, analysis.lost_writes) == (0, 0, 0)


def test_synchronous_mode_cancelled_waits_raise_not_replicated_and_nothing_acknowledged_is_lost(
    ha_sync, tmp_path
):
    """The standbys cut off: nothing is acknowledged; cancelled waits raise NotReplicated
    (not granted / indeterminate), waiting commits end indeterminate with the leader."""
    result = run(ha_sync, tmp_path, "patroni-sync-lag", "kill-lagging")
    analysis = judged(result, "patroni-sync-lag")
    assert analysis.not_replicated > 0
    assert analysis.unreplicated == 0, "a grant was acknowledged with the standbys cut off"
    assert (analysis.lost_grants, analysis.lost_renewals, analysis.lost_writes) == (0, 0, 0)


@pytest.fixture
def partitionable(request: pytest.FixtureRequest) -> Iterator[Patroni]:
    """A cluster of its own whose leader, pg0, can be cut from etcd alone; in Patroni's
    synchronous_mode if the test's parameter says so."""
    need_netns("the leader partitioned from etcd")
    ha = Patroni(isolated=Isolation())
    with running(ha) as leader:
        assert leader is ha.members[0], "the isolated member did not bootstrap the cluster"
        if request.param:
            ha.set_synchronous(True)
        yield ha


@full_only
@pytest.mark.parametrize("partitionable", [False, True], indirect=True,
                         ids=["asynchronous", "synchronous"])
def test_leader_partitioned_from_etcd_is_demoted_before_another_is_promoted(
    partitionable, tmp_path
):
    judged(run(partitionable, tmp_path, "patroni-partition", "partition"), "patroni-partition")


def paused(ha: Patroni, directory: Path, prefix: str) -> tuple[Outcome, dict[str, Any]]:
    """A run with the leader's machine paused (:func:`pause`); prints what it measured."""
    seen: dict[str, Any] = {}
    result = run(ha, directory, prefix, "pause", seen)
    is_lost = lost(result)
    resumed = [e for e in result.client if json.dumps(e, sort_keys=True) not in seen["before"]]
    seen["acknowledged_then_lost"] = there = [e for e in resumed if is_lost(e)]
    grants = [e for e in there if e["type"] == "acquire"]
    paused_us, promoted_us = seen["paused_us"], seen["promoted_us"]
    window = (seen["ended_us"] - seen["resumed_us"]) / 1e6
    patroni_window = (seen["ended_us"] - seen["patroni_resumed_us"]) / 1e6
    never = "" if seen["demoted_us"] else " (never demoted: killed by the test)"
    seen["overlaps"] = overlaps = overlapping(grants, [
        e for e in result.client if e.get("type") == "acquire" and e.get("status") == "ok"
        and not is_lost(e) and e["acquired_us"] > paused_us])
    seen["report"] = (
        f"paused leader: new leader writable {(promoted_us - paused_us) / 1e6:.1f} s "
        f"after the pause; watchdog resets at "
        f"{[round((t - paused_us) / 1e6, 1) for t in seen['resets']]} s; old primary "
        f"writable for {window:.1f} s after its PostgreSQL resumed, "
        f"{patroni_window:.1f} s after its Patroni did{never}; acknowledged there and lost: "
        f"{len(grants)} grants, {sum(e['type'] == 'renew' for e in there)} renewals, "
        f"{sum(e['type'] == 'write' for e in there)} writes; leases overlapping one granted "
        f"by the new leader: {overlaps}; every call answered after the resume, by status: "
        f"{dict(sorted(Counter(str(e.get('status')) for e in resumed).items()))}; commits seen "
        f"waiting for the synchronous standby: {seen.get('waiting', 0)}; the member first "
        f"promoted leads at the end: {seen['first_promoted_kept']}; answered by the old "
        f"primary with the new leader writable, before its Patroni resumed: "
        f"{seen.get('old_grants', 0)} grants, {seen.get('old_writes', 0)} writes")
    print("\n" + seen["report"])
    return result, seen


def overlapping(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> int:
    """How many of the ``old`` primary's grants overlap, by their leases as granted
    (acquired → expires, database clocks), a grant of the same lock by the ``new`` one:
    two holders at once, each told by a primary that it holds the lock."""
    return sum(
        any(o["lock"] == n["lock"] and o["acquired_us"] < n["expires_us"]
            and n["acquired_us"] < o["expires_us"] for n in new)
        for o in old
    )


@full_only
def test_paused_leader_without_watchdog_takes_writes_beside_the_new_leader(ha, tmp_path):
    """The control: asynchronous, no watchdog. The resumed old primary acknowledges grants
    and fenced writes while another member is the leader; once Patroni demotes it they are
    lost with its timeline."""
    result, seen = paused(ha, tmp_path, "patroni-pause")
    analysis = analyse(result, profile("patroni-pause").names(), VOLUME)
    print("\n" + analysis.summary(result))
    # Two primaries: the old one answered grants and fenced writes with the new one
    # writable (the resume order makes it certain; pause() waited for them).
    assert seen["old_grants"] > 0 and seen["old_writes"] > 0
    if seen["demoted_us"] is not None:
        # Patroni demoted it: what it acknowledged is lost with its timeline. (When
        # Patroni took the key back instead, whichever timeline ends up leading decides.)
        there = seen["acknowledged_then_lost"]
        assert any(e["type"] == "acquire" for e in there)
        assert any(e["type"] == "write" for e in there)


@full_only
def test_paused_leader_in_synchronous_mode_acknowledges_nothing_beside_the_new_leader(
    ha_sync, tmp_path
):
    """No watchdog, ``synchronous_mode``: the resumed old primary's commits wait for its
    synchronous standby, which is now the leader; none is acknowledged there before
    Patroni demotes it. If Patroni instead takes the leader key back (its 3.0.2 bug), the
    run is an expected failure with its count, not a pass."""
    result, seen = paused(ha_sync, tmp_path, "patroni-sync-pause")
    if seen["demoted_us"] is None:
        # Not what synchronous mode is judged on: Debian's Patroni 3.0.2 wrote the leader
        # key over the new leader's (patroni#2689, docs/deployment.md), and the old
        # primary, leader again, named a synchronous standby and committed.
        there = seen["acknowledged_then_lost"]
        names = profile("patroni-sync-pause").names()
        print("\n" + analyse(result, names, VOLUME).summary(result))
        # -rA shows no output of an expected failure: the figures go in its reason.
        pytest.xfail(f"Patroni 3.0.2 took the leader key back (patroni#2689); the old primary "
                     f"acknowledged {len(there)} calls beside the new leader. {seen['report']}")
    analysis = judged(result, "patroni-sync-pause")
    assert seen["waiting"] > 0, "no commit waited on the resumed old primary"
    assert seen["acknowledged_then_lost"] == [] and seen["overlaps"] == 0
    assert (analysis.lost_grants, analysis.lost_renewals, analysis.lost_writes) == (0, 0, 0)


@pytest.fixture(scope="module")
def guarded() -> Iterator[Patroni]:
    """A cluster of its own whose members run Patroni's watchdog (``mode: required``) on
    emulated devices (tests/support/watchdog.py), asynchronous replication."""
    ha = Patroni(watchdog_margin=WATCHDOG_MARGIN)
    with running(ha):
        yield ha


@full_only
def test_paused_leader_with_watchdog_is_reset_before_the_new_leader_is_promoted(
    guarded, tmp_path
):
    """Asynchronous, the watchdog on: the paused leader's device expires ``ttl -
    safety_margin`` after its last keepalive and the emulated reset kills the machine
    before the leader key expires; nothing is left to resume, and nothing is acknowledged
    beside the new leader."""
    leader = guarded.wait_leader(60)
    device = guarded.watchdogs[leader.name]
    assert device.armed and device.timeout == TTL - WATCHDOG_MARGIN, "Patroni did not arm it"
    result, seen = paused(guarded, tmp_path, "patroni-watchdog")
    judged(result, "patroni-watchdog")
    assert len(seen["resets"]) == 1 and seen["resets"][0] < seen["promoted_us"]
    assert seen["other_resets"] == []
    assert not seen["old_writable"]
    assert seen["acknowledged_then_lost"] == [] and seen["overlaps"] == 0
    new = next(m for m in guarded.members if m.process is not None and writable(m))
    assert guarded.watchdogs[new.name].armed, "the new leader runs without its watchdog"


def emulated_device(tmp_path: Path) -> tuple[Watchdog, list[float], int]:
    """An emulated watchdog device that records its resets, and a writer's end of it."""
    resets: list[float] = []
    watchdog = Watchdog(tmp_path / "watchdog", lambda: resets.append(time.time()))
    watchdog.start()
    return watchdog, resets, os.open(tmp_path / "watchdog", os.O_WRONLY)


@full_only
def test_emulated_watchdog_resets_a_timeout_after_the_last_keepalive_and_not_before(
    tmp_path
):
    """The device the watchdog run relies on resets only when the keepalives stop for
    the timeout Patroni set (the bytes of its ``driver: testing``)."""
    watchdog, resets, fd = emulated_device(tmp_path)
    try:
        os.write(fd, b"Ctimeout=1\n")
        started = time.time()
        last = started
        while time.time() < started + 1.5:
            os.write(fd, b"1")
            last = time.time()
            time.sleep(0.1)
        wait_until(lambda: resets, 10, "the emulated reset")
        # Never before the timeout after a keepalive, however late the thread ran.
        assert resets[0] - last >= 1.0
        assert len(resets) == 1 and not watchdog.armed
    finally:
        os.close(fd)
        watchdog.stop()


@full_only
def test_emulated_watchdog_is_disarmed_by_a_magic_close(tmp_path):
    watchdog, resets, fd = emulated_device(tmp_path)
    try:
        os.write(fd, b"Ctimeout=1\n1")
        wait_until(lambda: watchdog.armed, 10, "armed")
        os.write(fd, b"V")
        wait_until(lambda: not watchdog.armed, 10, "disarmed")
        time.sleep(1.5)  # longer than the timeout: a reset would have come by now
        assert resets == []
    finally:
        os.close(fd)
        watchdog.stop()
