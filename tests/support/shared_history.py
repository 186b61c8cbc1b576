"""The history check of semaphores and read/write locks, over the lock table's own log.

tests/stress/harness.py's triggers log every grant, renewal and end of every lock row in
the changing transaction, with database-clock times. A semaphore or read/write lock is
several rows; this rebuilds each row's leases with the stress checker
(tests/stress/checker.py, which also checks tokens per row) and then judges the name as
a whole: how many leases overlap at any database instant (at most ``limit``), whether a
writer's lease overlaps any other, and whether the grants' tokens rise strictly in the
order the database made them (the log's id order: grants of one name are serialized on
its head row).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tests.stress.checker import Report, leases_from


@dataclass
class SharedReport:
    grants: int = 0
    most_at_once: int = 0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def check_shared(
    history: Iterable[Mapping[str, Any]], name: str, *, limit: int, members: str,
    writer: str | None = None,
) -> SharedReport:
    """Judge the leases of the rows whose names start with ``members`` (the head row is
    not one of them); ``writer`` is the row whose leases must overlap no other."""
    rows = sorted(
        (row for row in history if str(row["name"]).startswith(members)
         or row["name"] == writer),
        key=lambda row: row["id"],
    )
    report = SharedReport()
    per_row = Report()
    leases = leases_from(rows, per_row)
    report.violations += [f"({check}) {message}" for check, message in per_row.violations]
    last = 0
    for row in rows:
        if row["kind"] != "grant":
            continue
        report.grants += 1
        token = int(row["token"])
        if token <= last:
            report.violations.append(
                f"{name}: token {token} granted ({row['name']}) after token {last}")
        last = max(last, token)
    spans = [lease for ordered in leases.values() for lease in ordered]
    # An end at t and a start at t do not overlap (a lease holds in [start, end)).
    events = sorted(
        [(lease.start, 1) for lease in spans] + [(lease.end, -1) for lease in spans]
    )
    current = 0
    for at, step in events:
        current += step
        if current > limit:
            report.violations.append(f"{name}: {current} leases at once at {at} µs")
        report.most_at_once = max(report.most_at_once, current)
    if writer is not None:
        for lease in leases.get(writer, []):
            for other in spans:
                if other is not lease and other.start < lease.end and lease.start < other.end:
                    report.violations.append(
                        f"{name}: write token {lease.token} [{lease.start}, {lease.end}) "
                        f"overlaps {other.name} token {other.token} "
                        f"[{other.start}, {other.end})")
    return report
