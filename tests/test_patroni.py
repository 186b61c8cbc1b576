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

CI runs the synchronous cancelled-wait fault; the plain synchronous kill and the etcd
partition run with ``DISTLOCK_HA_FULL=1`` (the closing figures' runs; ``scripts/ha``
documents the command).

Each prints its summary (-rA): grants, writes, refusals, indeterminate outcomes, violations,
tokens issued again, the longest time no grant was acknowledged. Runs in the PostgreSQL
pass (slow); one cluster for the module, brought back to three streaming members before
each test (a killed member comes back as a fresh clone).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stress import checker
from tests.stress.harness import HISTORY, Profile, read_histories, trigger_statements
from tests.support.failover import (
    Analysis,
    Outcome,
    analyse,
    contending,
    seed,
    tables,
    told_not_replicated,
    wait_for_grants,
)
from tests.support.helpers import wait_until
from tests.support.namespaces import need_netns
from tests.support.patroni import Isolation, Member, Patroni
from tests.support.pg_clusters import now_us

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


def profile(prefix: str) -> Profile:
    return Profile(workers=4, locks=2, ttl=0.5, fault_seconds=90.0, skewed_clocks=False,
                   prefix=prefix)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Patroni]:
    ha = Patroni()
    try:
        ha.start()
        leader = ha.wait_leader(60)
        for statement in trigger_statements("postgresql"):
            leader.query(statement)
        yield ha
    finally:
        ha.stop()


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


def run(ha: Patroni, directory: Path, prefix: str, fault: str) -> Outcome:
    """Contend, make the fault, wait for grants by the leader after it, stop."""
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
    try:
        ha.start()
        leader = ha.wait_leader(60)
        assert leader is ha.members[0], "the isolated member did not bootstrap the cluster"
        for statement in trigger_statements("postgresql"):
            leader.query(statement)
        if request.param:
            ha.set_synchronous(True)
        yield ha
    finally:
        ha.stop()


@full_only
@pytest.mark.parametrize("partitionable", [False, True], indirect=True,
                         ids=["asynchronous", "synchronous"])
def test_leader_partitioned_from_etcd_is_demoted_before_another_is_promoted(
    partitionable, tmp_path
):
    judged(run(partitionable, tmp_path, "patroni-partition", "partition"), "patroni-partition")
