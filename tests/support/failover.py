"""What a failover run saw, and its analysis: shared by the failover tests
(tests/test_failover.py, a promoted streaming standby) and the Patroni tests
(tests/test_patroni.py).

Both set up the same way: :func:`seed` one Resource row per lock, :func:`contending`
worker processes, and after the fault :func:`tables` read from the new primary.

The clients' histories (tests/stress/harness.py) are split into what the new primary has
and what was acknowledged but lost with the old one; the rest is judged by the stress
harness's history checker; each lock's tokens acknowledged before the fault are compared
with those granted after the new primary took over (a token not above every earlier one
was issued again).
"""

from __future__ import annotations

import contextlib
import random
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.stress import checker
from tests.stress.harness import HISTORY, Profile, Workers, read_histories
from tests.support.helpers import wait_until

Rows = list[dict[str, Any]]


def seed(query: Callable[[str, list[Any]], object], names: Iterable[str]) -> None:
    """One Resource row (value 0) per lock name, through ``query`` (a server's)."""
    for name in names:
        query("INSERT INTO stressapp_resource (name, value, version, fence_token) "
              "VALUES (%s, 0, 0, 0)", [name])


@contextlib.contextmanager
def contending(profile: Profile, directory: Path, env: dict[str, str]) -> Iterator[Workers]:
    """``profile.workers`` stress workers on PostgreSQL (``env``: the cluster's), backing
    off 50 ms after a failed call as a client of a server that is down; killed at the end
    (by PID) whatever happened."""
    workers = Workers(profile, random.randrange(2**32), directory, "postgresql", env=env,
                      pause_after_error=0.05)
    try:
        for slot in range(profile.workers):
            workers.start(slot)
        yield workers
    finally:
        workers.kill_all()


def tables(rows: Callable[[str], Rows], leave_out: Iterable[str] = ()) -> dict[str, Any]:
    """What the new primary has, as :class:`Outcome` takes it: the lock history, the
    ground-truth writes, the Resource rows by name (less ``leave_out``)."""
    skipped = set(leave_out)
    return {
        "history": rows(HISTORY), "writes": rows("stressapp_write"),
        "resources": {row["name"]: row for row in rows("stressapp_resource")
                      if row["name"] not in skipped},
    }


@dataclass
class Outcome:
    """What a failover run saw: the clients' histories and the new primary's tables."""

    label: str
    client: list[dict[str, Any]]
    history: list[dict[str, Any]]
    writes: list[dict[str, Any]]
    resources: dict[str, dict[str, Any]]
    cut_us: int
    dead_us: int
    promote_us: int
    held: dict[str, Any] = field(default_factory=dict)
    held_after: list[dict[str, Any]] = field(default_factory=list)
    held_row: dict[str, Any] | None = None
    #: The new primary's token floor at the end: (timeline recorded, token).
    floor: tuple[int | None, int] = (None, 0)
    lag_bytes: int = 0
    step_output: str = ""


@dataclass
class Analysis:
    """The history checker's report on what the new primary has, plus the failover's own
    counts: what was acknowledged but is not there (lost), and tokens issued again."""

    report: checker.Report
    names: list[str] = field(default_factory=list)
    before: int = 0
    unreplicated: int = 0
    after: int = 0
    lost_grants: int = 0
    lost_renewals: int = 0
    lost_writes: int = 0
    reissued: int = 0
    #: Grants, renewals and writes a client was told NotReplicated for (a cancelled wait
    #: for the synchronous standby): not acknowledged, so never counted as lost.
    not_replicated: int = 0
    #: The longest time between two acknowledged grants around the fault (seconds).
    unavailable: float = 0.0
    max_before: dict[str, int] = field(default_factory=dict)
    min_after: dict[str, int] = field(default_factory=dict)

    def tokens(self) -> str:
        return ", ".join(
            f"{name} {self.max_before.get(name)} / {self.min_after.get(name)}"
            for name in self.names
        )

    def summary(self, outcome: Outcome) -> str:
        return (
            f"distlock failover [{outcome.label}]: acknowledged grants before the crash="
            f"{self.before} ({self.unreplicated} after the standby stopped receiving), "
            f"after the promotion={self.after}; lost (acknowledged, not on the "
            f"new primary): grants={self.lost_grants} renewals={self.lost_renewals} "
            f"writes={self.lost_writes}; NotReplicated={self.not_replicated}; "
            f"tokens issued again={self.reissued}; "
            f"WAL the standby lacked={outcome.lag_bytes} B; per lock, highest token before / "
            f"lowest after: {self.tokens()}; no grant acknowledged for "
            f"{self.unavailable:.1f} s"
            f"\n  history: {self.report.summary()}"
        )


def told_not_replicated(event: dict[str, Any]) -> bool:
    """Whether a client was told NotReplicated for this operation (tests/support/
    stress_workers.py: status ``not_replicated``, or an indeterminate write marked so)."""
    return event.get("status") == "not_replicated" or bool(event.get("not_replicated"))


def acknowledged_grants(directory: Path, since_us: int = 0) -> dict[str, int]:
    """Acknowledged grants per lock whose grant time (database clock) is after ``since_us``."""
    counts: dict[str, int] = defaultdict(int)
    for event in read_histories(directory):
        acknowledged = event.get("type") == "acquire" and event.get("status") == "ok"
        if acknowledged and event["acquired_us"] > since_us:
            counts[event["lock"]] += 1
    return counts


def wait_for_grants(directory: Path, names: list[str], since_us: int, each: int, what: str,
                    refusals: int = 0, deadline: float = 60.0) -> None:
    def enough() -> bool:
        counts = acknowledged_grants(directory, since_us)
        if any(counts[name] < each for name in names):
            return False
        refused = sum(
            1 for event in read_histories(directory)
            if event.get("type") == "write" and event.get("status") == "rejected"
        )
        return refused >= refusals

    wait_until(enough, deadline, what, every=0.1)


def lost(outcome: Outcome) -> Callable[[dict[str, Any]], bool]:
    """Whether a client event is an acknowledged grant, renewal or fenced write that the
    new primary's tables lack: acknowledged, then lost with the old primary's timeline."""
    granted = {(row["name"], int(row["token"]), row["owner"])
               for row in outcome.history if row["kind"] == "grant"}
    renewed = {(row["name"], int(row["token"]), int(row["expires_us"]))
               for row in outcome.history if row["kind"] == "renew"}
    written = {row["op_id"] for row in outcome.writes}

    def missing(event: dict[str, Any]) -> bool:
        if event.get("status") != "ok":
            return False
        kind = event.get("type")
        if kind == "acquire":
            return (event["lock"], int(event["token"]), event["owner"]) not in granted
        if kind == "renew":
            return (event["lock"], int(event["token"]), int(event["expires_us"])) not in renewed
        return kind == "write" and event["op_id"] not in written

    return missing


def analyse(outcome: Outcome, names: list[str], volume: checker.Volume) -> Analysis:
    """Split the acknowledged operations into those the new primary has and those it lost,
    check the rest with the stress harness's history checker, and compare each lock's
    tokens before the crash with those after the promotion."""
    is_lost = lost(outcome)
    wanted = set(names)
    kept: list[dict[str, Any]] = []
    counts = Analysis(report=checker.Report(), names=list(names))
    for event in outcome.client:
        counts.not_replicated += told_not_replicated(event)
        if is_lost(event):
            kind = event["type"]
            counts.lost_grants += kind == "acquire"
            counts.lost_renewals += kind == "renew"
            counts.lost_writes += kind == "write"
            continue
        kept.append(event)
    report = checker.check(
        lock_history=[row for row in outcome.history if row["name"] in wanted],
        writes=outcome.writes, resources=outcome.resources, client=kept, liveness={},
        volume=volume, live_within=0.0,
    )
    counts.report = report
    before: dict[str, list[int]] = defaultdict(list)
    after: dict[str, list[int]] = defaultdict(list)
    owners: dict[tuple[str, int], set[str]] = defaultdict(set)
    for event in outcome.client:
        if event.get("type") != "acquire" or event.get("status") != "ok":
            continue
        name, token = event["lock"], int(event["token"])
        owners[name, token].add(event["owner"])
        if event["acquired_us"] < outcome.dead_us:
            before[name].append(token)
            counts.unreplicated += event["acquired_us"] > outcome.cut_us
        elif event["acquired_us"] > outcome.promote_us:
            after[name].append(token)
        else:
            report.add("f", f"{name}: token {token} granted at {event['acquired_us']}, "
                       "between the primary's death and the promotion")
    counts.before = sum(map(len, before.values()))
    counts.after = sum(map(len, after.values()))
    for name in sorted(wanted):
        if not before[name] or not after[name]:
            report.add("e", f"{name}: no grants before the crash or none after it")
            continue
        counts.max_before[name] = top = max(before[name])
        counts.min_after[name] = min(after[name])
        for token in sorted(after[name]):
            if token <= top:
                counts.reissued += 1
                report.add("f", f"{name}: token {token} granted after the failover, not above "
                           f"token {top} acknowledged before the crash")
    for (name, token), holders in sorted(owners.items()):
        if len(holders) > 1:
            report.add("f", f"{name}: token {token} was handed to {len(holders)} owners")
    counts.unavailable = unavailable_seconds(outcome.client, outcome.dead_us)
    return counts


def unavailable_seconds(client: list[dict[str, Any]], fault_us: int) -> float:
    """The longest time, in seconds, between two acknowledged grants (by the time each
    was granted) from the last one before ``fault_us`` on: how long the lock service
    granted nothing around the fault."""
    times = sorted(
        int(event["acquired_us"]) for event in client
        if event.get("type") == "acquire" and event.get("status") == "ok"
    )
    before = [t for t in times if t < fault_us]
    after = [t for t in times if t >= fault_us]
    window = before[-1:] + after
    return max((b - a for a, b in zip(window, window[1:], strict=False)), default=0) / 1e6
