"""The comparison lab (lab/, scripts/compare) measures what it claims to.

One quick run of the pause scenario for redis-py's Lock and for distlock fenced, with
real processes (its own redis-server, two clients each, a SIGSTOP): the columns of the
table must show the seed's argument — Redis accepts the paused holder's stale write and
loses an update, distlock fenced refuses it — and the controls (the same harness, fault
off) must be clean. The history judge (lab.scenarios.measure) is also checked alone, on
made-up histories, on every backend (it needs no database). The PostgreSQL failover
and etcd member-loss scenarios have a quick run each; the partition scenario's (redis and
distlock fenced, A on a network namespace of its own) runs with ``DISTLOCK_LAB_FULL=1``
only, as it costs more than a CI test may.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from lab.report import broken_controls, html, text
from lab.scenarios import Event, Trial, measure, reissued
from tests.support.namespaces import need_netns

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = os.environ.get("DISTLOCK_TEST_DB_SUFFIX", "")
CLIENTS_OWN_DATABASE = "the lab's clients connect to a database of their own"


def lab_process_test(pooler_reason: str, program: str | None = None, package: str = "",
                     *, full: bool = False) -> Any:
    """The marks of a test that runs the lab with real processes: slow, in the PostgreSQL
    pass (the lab keeps its resource there), and, outside CI, only where ``program`` (from
    Debian's ``package``) is installed. ``full``: one of the lab's full set, which runs
    only with ``DISTLOCK_LAB_FULL=1`` (over CI's budget for a test: its scenario runs in
    CI in ``scripts/compare --quick``)."""
    marks = [
        pytest.mark.slow, pytest.mark.processes, pytest.mark.no_pooler(pooler_reason),
        pytest.mark.skipif(os.environ.get("DISTLOCK_TEST_BACKEND") != "postgresql",
                           reason="the lab keeps its resource on PostgreSQL: the PostgreSQL pass"),
    ]
    if full:
        marks.append(pytest.mark.skipif(os.environ.get("DISTLOCK_LAB_FULL") != "1",
                                        reason="one of the lab's full set (DISTLOCK_LAB_FULL=1)"))
    if program is not None:
        marks.append(pytest.mark.skipif(
            shutil.which(program) is None and os.environ.get("CI") != "true",
            reason=f"needs Debian's {package}"))

    def mark(test: Any) -> Any:
        for each in reversed(marks):
            test = each(test)
        return test

    return mark


def history(*events: tuple[str, str, float, object]) -> Trial:
    trial = Trial(fault=True)
    trial.events = [Event(client, op, t, t + 0.01, result) for client, op, t, result in events]
    return trial


def test_a_write_after_another_grant_is_stale_and_counted_accepted_or_refused() -> None:
    accepted = history(("A", "acquire", 0, 1), ("A", "read", 0.1, 0), ("B", "acquire", 0.2, 2),
                       ("B", "write", 0.3, True), ("A", "write", 0.4, True),
                       ("A", "release", 0.5, False), ("B", "release", 0.6, True))
    measure(accepted, total=1)
    assert (accepted.overlapping, accepted.stale_accepted, accepted.stale_refused) == (True, 1, 0)
    assert (accepted.increments, accepted.total, accepted.lost) == (2, 1, 1)

    refused = history(("A", "acquire", 0, 1), ("B", "acquire", 0.2, 2),
                      ("B", "write", 0.3, True), ("A", "write", 0.4, False),
                      ("A", "release", 0.5, False), ("B", "release", 0.6, True))
    measure(refused, total=1)
    assert (refused.stale_accepted, refused.stale_refused, refused.lost) == (0, 1, 0)


def test_one_holder_after_the_other_is_no_overlap_and_no_stale_write() -> None:
    control = history(("A", "acquire", 0, 1), ("A", "write", 0.1, True),
                      ("A", "release", 0.2, True), ("B", "acquire", 0.1, 2),
                      ("B", "write", 0.4, True), ("B", "release", 0.5, True))
    control.events[3].t1 = 0.3  # B asked during A's section, was granted after A's release
    measure(control, total=2)
    assert (control.overlapping, control.stale_accepted, control.stale_refused,
            control.lost) == (False, 0, 0, 0)


def test_a_token_not_above_an_earlier_grants_is_counted_issued_again() -> None:
    again = history(("A", "acquire", 0, 41), ("B", "acquire", 0.2, 41),
                    ("B", "write", 0.3, True), ("A", "write", 0.4, True))
    measure(again, total=1)
    assert again.reissued == 1
    raised = history(("A", "acquire", 0, 41), ("B", "acquire", 0.2, 1_000_000_041))
    lower = history(("A", "acquire", 0, 41), ("B", "acquire", 0.2, 7))
    assert (reissued(raised.events), reissued(lower.events)) == (0, 1)
    # Redis and Redlock tokens are random text, and a refused ask (None) is no grant.
    texts = history(("A", "acquire", 0, "f00"), ("B", "acquire", 0.2, "a11"),
                    ("B", "acquire", 0.3, None))
    assert reissued(texts.events) == 0


def test_a_control_with_a_token_issued_again_is_a_broken_control() -> None:
    cell = {"contender": "distlock", "scenario": "pg-failover", "fault": False, "trials": 1,
            "overlapping": 0, "stale_accepted": 0, "stale_refused": 0, "increments": 2,
            "total": 2, "lost": 0, "reissued": 1, "timeline": None}
    results = {"cells": [cell], "rates": {}, "notes": [], "command": "x", "seconds": 1}
    assert broken_controls(results) == ["distlock × pg-failover: 0 overlapping, 0 stale, "
                                        "0 lost, 1 tokens again"]
    assert broken_controls({**results, "cells": [{**cell, "reissued": 0}]}) == []


def lab_database() -> str:
    url = urlsplit(os.environ.get("DISTLOCK_TEST_POSTGRES",
                                  "postgresql://postgres@127.0.0.1:5432/test"))
    return urlunsplit(url._replace(path=f"/distlock_lab_test{SUFFIX}"))


@lab_process_test(CLIENTS_OWN_DATABASE, "redis-server", "redis-server")
def test_pause_redis_accepts_the_stale_write_and_distlock_fenced_refuses_it(
        tmp_path: Path) -> None:
    results_file = tmp_path / "results.json"
    run = subprocess.run(
        [sys.executable, "-m", "lab.compare", "--trials", "1", "--ttl", "2",
         "--contenders", "redis,distlock-fenced", "--scenarios", "pause",
         "--rate-seconds", "0", "--postgres", lab_database(), "--json", str(results_file)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(results_file.read_text())
    cells = {(c["contender"], c["fault"]): c for c in results["cells"]}
    columns = ("trials", "overlapping", "stale_accepted", "stale_refused", "increments", "total",
               "lost")

    def row(contender: str, fault: bool) -> tuple[int, ...]:
        return tuple(cells[contender, fault][column] for column in columns)

    assert row("redis", False) == (1, 0, 0, 0, 2, 2, 0)
    assert row("redis", True) == (1, 1, 1, 0, 2, 1, 1)
    assert row("distlock-fenced", False) == (1, 0, 0, 0, 2, 2, 0)
    assert row("distlock-fenced", True) == (1, 1, 0, 1, 1, 1, 0)
    assert broken_controls(results) == []
    table = text(results)
    assert "redis            pause     on             1       1            1" in table
    page = html(results)
    assert page.count("<svg") == 2 and 'class="bad"' in page


def lab_run(tmp_path: Path, *args: str) -> dict[str, tuple[int, ...]]:
    """``python -m lab.compare ARGS`` (one trial, no rates) on a database of this test run;
    each cell's columns by "contender scenario on|off"."""
    results_file = tmp_path / "results.json"
    run = subprocess.run(
        [sys.executable, "-m", "lab.compare", "--trials", "1", "--rate-seconds", "0",
         "--postgres", lab_database(), "--json", str(results_file), *args],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(results_file.read_text())
    assert broken_controls(results) == []
    columns = ("trials", "overlapping", "stale_accepted", "stale_refused", "increments", "total",
               "lost", "reissued")
    return {f"{c['contender']} {c['scenario']} {'on' if c['fault'] else 'off'}":
            tuple(c[column] for column in columns) for c in results["cells"]}


@lab_process_test("the lab runs its own PostgreSQL primary and standby")
def test_pg_failover_reissues_the_lost_grants_token_only_without_follow_or_step(
        tmp_path: Path) -> None:
    """A grant the standby never received, then the primary's crash and the standby's
    promotion: B is granted A's token again only with neither the timeline follow nor the
    operator step; A's stale fenced write is refused in every variant (the lost grant's
    lock row is lost with it, and B's is there); the controls are clean. (The lab's quick
    mode in .ci/run leaves these cells to this test: the same cells, once.)"""
    cells = lab_run(tmp_path, "--contenders", "distlock-fenced", "--scenarios",
                    "pg-failover,pg-failover-step,pg-failover-nostep")
    clean = (1, 0, 0, 0, 2, 2, 0, 0)
    for variant in ("pg-failover", "pg-failover-step", "pg-failover-nostep"):
        assert cells[f"distlock-fenced {variant} off"] == clean
    assert cells["distlock-fenced pg-failover on"] == (1, 1, 0, 1, 1, 1, 0, 0)
    assert cells["distlock-fenced pg-failover-step on"] == (1, 1, 0, 1, 1, 1, 0, 0)
    assert cells["distlock-fenced pg-failover-nostep on"] == (1, 1, 0, 1, 1, 1, 0, 1)


@lab_process_test(CLIENTS_OWN_DATABASE, "etcd", "etcd-server")
def test_etcd_member_loss_the_leader_the_clients_use_keeps_the_lock(tmp_path: Path) -> None:
    """The etcd leader, which is the member the clients talk to, killed while A holds:
    the other two elect a leader, B (asking through the next member) is not granted while
    A's lease lasts, and A's write is accepted and not stale."""
    cells = lab_run(tmp_path, "--contenders", "etcd", "--scenarios", "etcd-member")
    assert cells["etcd etcd-member off"] == (1, 0, 0, 0, 2, 2, 0, 0)
    assert cells["etcd etcd-member on"] == (1, 0, 0, 0, 1, 1, 0, 0)


# 8.7 to 12.2 s a run (ten runs, load 2 to 3): over CI's 10 s, so in the full set.
@lab_process_test("the lab runs its own PostgreSQL server on a namespace's link", "ip",
                  "iproute2", full=True)
def test_partition_redis_accepts_the_cut_off_holders_stale_write_and_fenced_refuses_it(
        tmp_path: Path) -> None:
    """A on a network namespace of its own, cut off while it holds: its lease runs out, B
    is granted and writes, the link heals and A writes with its old lease. redis-py's Lock
    lets the stale write through (an update lost), distlock fenced refuses it; the controls
    (the link never cut) are clean. The scenario itself checks that the cut holds (A's
    host reaches no server) and that the control's link carries A's traffic."""
    need_netns("the lab's partition scenario")
    cells = lab_run(tmp_path, "--contenders", "redis,distlock-fenced", "--scenarios",
                    "partition")
    clean = (1, 0, 0, 0, 2, 2, 0, 0)
    assert cells["redis partition off"] == clean
    assert cells["distlock-fenced partition off"] == clean
    assert cells["redis partition on"] == (1, 1, 1, 0, 2, 1, 1, 0)
    assert cells["distlock-fenced partition on"] == (1, 1, 0, 1, 1, 1, 0, 0)
