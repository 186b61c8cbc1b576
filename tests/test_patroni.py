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
* one etcd member SIGKILLed: no failover, the locks go on.

Each prints its summary (-rA): grants, writes, refusals, indeterminate outcomes, violations,
tokens issued again, the longest time no grant was acknowledged. Runs in the PostgreSQL
pass (slow); one cluster for the module, brought back to three streaming members before
each test (a killed member comes back as a fresh clone).
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stress import checker
from tests.stress.harness import HISTORY, Profile, Workers, read_histories, trigger_statements
from tests.support.failover import Analysis, Outcome, analyse, wait_for_grants
from tests.support.patroni import Member, Patroni
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


@pytest.fixture
def ha(cluster: Patroni) -> Patroni:
    cluster.restore()
    return cluster


def run(ha: Patroni, directory: Path, prefix: str, fault: str) -> Outcome:
    """Contend, make the fault, wait for grants by the leader after it, stop."""
    names = profile(prefix).names()
    leader = ha.wait_leader(60)
    leader.query(f"TRUNCATE {HISTORY}, stressapp_write")
    leader.query("DELETE FROM stressapp_resource")
    for name in names:
        leader.query("INSERT INTO stressapp_resource (name, value, version, fence_token) "
                     "VALUES (%s, 0, 0, 0)", [name])
    workers = Workers(profile(prefix), random.randrange(2**32), directory, "postgresql",
                      env=ha.env(), pause_after_error=0.05)
    try:
        for slot in range(4):
            workers.start(slot)
        wait_for_grants(directory, names, 0, BEFORE, f"{BEFORE} grants of each lock",
                        deadline=DEADLINE)
        cut_us = fault_us = now_us()
        if fault in ("kill", "kill-lagging"):
            if fault == "kill-lagging":
                stop_wal_senders(leader)
                cut_us = now_us()
                wait_for_grants(directory, names, cut_us, 3,
                                "3 grants of each lock the standbys lack", deadline=DEADLINE)
            fault_us = now_us()
            ha.kill_member(leader)
            ha.kill_server(leader)
            after = ha.wait_leader(DEADLINE, other_than=leader)
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
    finally:
        workers.kill_all()


def stop_wal_senders(leader: Member) -> None:
    """SIGSTOP the leader's WAL senders: the standbys receive nothing more (stopping the
    receivers would not do: what the sender wrote waits in the socket for them)."""
    pids = [pid for (pid,) in leader.query("SELECT pid FROM pg_stat_replication",
                                           dbname="postgres")]
    assert pids, "no WAL sender on the leader"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def outcome(leader: Member, directory: Path, label: str, cut_us: int,
            fault_us: int) -> Outcome:
    return Outcome(
        label=f"patroni: {label}", client=read_histories(directory),
        history=leader.rows(HISTORY), writes=leader.rows("stressapp_write"),
        resources={row["name"]: row for row in leader.rows("stressapp_resource")},
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
