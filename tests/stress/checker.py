"""The history checker: pure Python over what the database and the workers recorded.

Inputs (see tests/stressapp/models.py and tests/support/stress_workers.py):

* ``lock_history``: every change of every lock row, written by triggers in the same
  transaction as the change (``grant``, ``renew``, ``end``), with database-clock times;
* ``writes``: every accepted write to a Resource, committed with it;
* ``resources``: the final value, version and fence_token of each Resource;
* ``client``: the workers' own histories (what each call returned to them);
* ``liveness``: after healing, how long a fresh acquire of each lock took.

The checks, lettered as in issue 6 and anchors-reliability.md §5.4:

(a) no two leases of a lock overlap, in token order: a grant starts no earlier than the
    previous lease ended (its expiry, extended by renewals, or its release/break);
(b) tokens strictly increase per lock in grant order, and per worker; every lease (and
    renewal) a client was handed is one the database granted (no phantom lease);
(c) the resource never accepted a lower token (``fence_token`` order along versions), and
    every accepted write ran inside its lease and ended no later than the next grant;
    no write the client saw refused is in the table;
(d) no acknowledged write lost or duplicated: each acknowledged op is in the table
    exactly once, versions are 1..n, each write read the previous write's value;
(e) liveness after healing, and a minimum volume: a run that did too little to show
    anything is reported as a violation ("vacuous"), never as a pass.

Indeterminate writes: a write whose client never heard how it ended (status ``info``: the
connection broke or the network was cut while the call ran — the COMMIT may never have
reached the server, or reached it and its answer was lost) may or may not be in the
table, and both are accepted: absent, it is not a lost write (d); present, it is judged
like every other row by (c) and (d) — inside its lease, no lower token after a higher
one, the previous write's value read — and its token must be the one its client held.
The report counts them and how many were applied.

Nothing here reads a clock: every comparison is between database timestamps.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Row = Mapping[str, Any]


@dataclass(frozen=True)
class Volume:
    """The least a run must have done to count (check e)."""

    grants: int = 100
    writes: int = 60
    stale_refused: int = 10


@dataclass
class Lease:
    name: str
    token: int
    owner: str
    start: int
    expires: int
    ended: int | None = None
    renewals: int = 0
    granted_expires: int = 0
    renewed_to: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.granted_expires = self.expires

    @property
    def end(self) -> int:
        return self.expires if self.ended is None else min(self.expires, self.ended)


@dataclass
class Report:
    grants: int = 0
    renewals: int = 0
    writes: int = 0
    stale_refused: int = 0
    acknowledged: int = 0
    indeterminate: int = 0
    indeterminate_applied: int = 0
    violations: list[tuple[str, str]] = field(default_factory=list)

    def add(self, check: str, message: str) -> None:
        self.violations.append((check, message))

    def by_check(self) -> Counter[str]:
        return Counter(check for check, _ in self.violations)

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        kinds = self.by_check()
        detail = ", ".join(f"{check}={kinds[check]}" for check in sorted(kinds))
        return (
            f"grants={self.grants} renewals={self.renewals} writes={self.writes} "
            f"acknowledged={self.acknowledged} indeterminate={self.indeterminate} "
            f"({self.indeterminate_applied} applied) "
            f"stale_writes_refused={self.stale_refused} "
            f"violations={len(self.violations)}" + (f" ({detail})" if detail else "")
        )

    def describe(self, limit: int = 25) -> str:
        lines = [self.summary()]
        lines += [f"  ({check}) {message}" for check, message in self.violations[:limit]]
        if len(self.violations) > limit:
            lines.append(f"  … and {len(self.violations) - limit} more")
        return "\n".join(lines)


def leases_from(lock_history: Iterable[Row], report: Report) -> dict[str, list[Lease]]:
    """Rebuild each lock's leases from the trigger log, checking (b) on the way."""
    leases: dict[str, dict[int, Lease]] = defaultdict(dict)
    last: dict[str, Lease] = {}
    for row in sorted(lock_history, key=lambda row: row["id"]):
        name, token, kind = row["name"], int(row["token"]), row["kind"]
        if kind == "grant":
            report.grants += 1
            previous = last.get(name)
            if token in leases[name]:
                report.add("b", f"{name}: token {token} granted twice")
            elif previous is not None and token <= previous.token:
                report.add(
                    "b", f"{name}: token {token} granted after token {previous.token}"
                )
            if previous is not None and row["at_us"] < previous.start:
                report.add(
                    "b", f"{name}: grant of token {token} is dated before the grant of "
                    f"token {previous.token}"
                )
            lease = Lease(name, token, row["owner"], row["at_us"], row["expires_us"])
            leases[name][token] = lease
            last[name] = lease
            continue
        lease = leases[name].get(token)
        if lease is None:
            report.add("b", f"{name}: {kind} of token {token}, which was never granted")
            continue
        if kind == "renew":
            report.renewals += 1
            if lease.ended is not None or row["at_us"] >= lease.expires:
                report.add(
                    "a", f"{name}: token {token} renewed at {row['at_us']} after its lease "
                    f"ended at {lease.end}"
                )
            lease.expires = row["expires_us"]
            lease.renewals += 1
            lease.renewed_to.add(row["expires_us"])
        elif kind == "end" and lease.ended is None:
            lease.ended = row["at_us"]
    return {name: sorted(by_token.values(), key=lambda lease: lease.token)
            for name, by_token in leases.items()}


def check_overlap(leases: Mapping[str, list[Lease]], report: Report) -> None:
    """(a) In token order, each lease starts no earlier than the previous one ended."""
    for name, ordered in leases.items():
        for earlier, later in zip(ordered, ordered[1:], strict=False):
            if later.start < earlier.end:
                report.add(
                    "a", f"{name}: token {later.token} granted at {later.start}, "
                    f"{earlier.end - later.start} µs before token {earlier.token}'s lease "
                    f"ended at {earlier.end}"
                )


@dataclass
class Ops:
    """The clients' writes by outcome (op ids), and the token each op was made with."""

    acknowledged: set[str] = field(default_factory=set)
    rejected: set[str] = field(default_factory=set)
    unknown: set[str] = field(default_factory=set)
    tokens: dict[str, int] = field(default_factory=dict)


def check_client(
    client: Iterable[Row], leases: Mapping[str, list[Lease]], report: Report
) -> Ops:
    """(b) client side: no phantom lease, per-worker tokens increase. Returns the writes."""
    granted = {
        (name, lease.token): lease for name, ordered in leases.items() for lease in ordered
    }
    per_worker: dict[tuple[str, str], int] = {}
    ops = Ops()
    for event in client:
        kind, status = event.get("type"), event.get("status")
        if kind == "acquire" and status == "ok":
            name, token = event["lock"], int(event["token"])
            lease = granted.get((name, token))
            if lease is None or lease.owner != event["owner"]:
                report.add(
                    "b", f"{name}: worker {event['worker']} was handed token {token} "
                    f"(owner {event['owner'][:8]}), which the database never granted to it"
                )
            elif event.get("expires_us") != lease.granted_expires:
                report.add(
                    "b", f"{name}: token {token} handed out with expiry "
                    f"{event.get('expires_us')}, the database says {lease.granted_expires}"
                )
            key = (event["worker"], name)
            if key in per_worker and token <= per_worker[key]:
                report.add(
                    "b", f"{name}: worker {event['worker']} got token {token} after "
                    f"token {per_worker[key]}"
                )
            per_worker[key] = token
        elif kind == "renew" and status == "ok":
            lease = granted.get((event["lock"], int(event["token"])))
            if lease is None or event.get("expires_us") not in lease.renewed_to:
                report.add(
                    "b", f"{event['lock']}: worker {event['worker']} renewed token "
                    f"{event['token']} to {event.get('expires_us')}, a renewal the database "
                    "never recorded"
                )
        elif kind == "write":
            if event.get("token") is not None:
                ops.tokens[event["op_id"]] = int(event["token"])
            if status == "ok":
                ops.acknowledged.add(event["op_id"])
            elif status == "rejected":
                report.stale_refused += 1
                ops.rejected.add(event["op_id"])
            elif status == "info":
                ops.unknown.add(event["op_id"])
    report.acknowledged = len(ops.acknowledged)
    report.indeterminate = len(ops.unknown)
    return ops


def check_writes(
    writes: Iterable[Row], resources: Mapping[str, Row], leases: Mapping[str, list[Lease]],
    ops: Ops, report: Report,
) -> None:
    """(c) tokens and leases of accepted writes; (d) nothing lost, nothing duplicated.
    Indeterminate ops are in ``writes`` or not: either is accepted, and a present one is
    checked as any row is."""
    by_lock: dict[str, list[Row]] = defaultdict(list)
    op_count: Counter[str] = Counter()
    for row in writes:
        by_lock[row["name"]].append(row)
        op_count[row["op_id"]] += 1
    report.writes = sum(op_count.values())
    report.indeterminate_applied = len(ops.unknown & set(op_count))
    for op_id, count in op_count.items():
        if count > 1:
            report.add("d", f"op {op_id} was applied {count} times")
        if op_id in ops.rejected:
            report.add("c", f"op {op_id} was refused to its client but is in the table")
    for op_id in sorted(ops.acknowledged - set(op_count)):
        report.add("d", f"op {op_id} was acknowledged but its write is not in the table")
    for name in sorted(set(by_lock) | set(resources)):
        rows = sorted(by_lock.get(name, []), key=lambda row: row["version"])
        tokens = {lease.token: lease for lease in leases.get(name, [])}
        ordered = sorted(tokens)
        previous: Row | None = None
        for row in rows:
            token = int(row["token"])
            expected = 1 if previous is None else previous["version"] + 1
            if row["version"] != expected:
                report.add("d", f"{name}: version {row['version']} follows {expected - 1}")
            read_before = 0 if previous is None else previous["new_value"]
            if row["read_value"] != read_before:
                report.add(
                    "d", f"{name}: op {row['op_id']} (token {token}) read {row['read_value']}"
                    f" but the previous write had left {read_before}: a lost update"
                )
            if row["new_value"] != row["read_value"] + 1:
                report.add("d", f"{name}: op {row['op_id']} wrote {row['new_value']} "
                           f"after reading {row['read_value']}")
            held = ops.tokens.get(row["op_id"])
            if held is not None and held != token:
                report.add("c", f"{name}: op {row['op_id']} is in the table with token "
                           f"{token}, but its client held token {held}")
            if previous is not None and token < int(previous["token"]):
                report.add(
                    "c", f"{name}: version {row['version']} accepted token {token} after "
                    f"token {previous['token']}"
                )
            lease = tokens.get(token)
            if lease is None:
                report.add("c", f"{name}: op {row['op_id']} wrote with token {token}, "
                           "never granted")
            else:
                # Inclusive bounds and a strict "after" below: one clock reading shared
                # by two events does not order them (SQLite's clock ticks in ms: a write
                # and its holder's release, or a write and the next grant, can share one),
                # as for overlapping leases in (a).
                if not lease.start <= row["before_us"] <= lease.end:
                    report.add(
                        "c", f"{name}: op {row['op_id']} wrote with token {token} at "
                        f"{row['before_us']}, outside its lease [{lease.start}, {lease.end}]"
                    )
                later = [t for t in ordered if t > token]
                if later and row["after_us"] > tokens[later[0]].start:
                    report.add(
                        "c", f"{name}: op {row['op_id']} (token {token}) was still writing "
                        f"at {row['after_us']}, after token {later[0]} was granted at "
                        f"{tokens[later[0]].start}"
                    )
            previous = row
        resource = resources.get(name)
        if resource is None:
            report.add("d", f"{name}: writes recorded for a resource that does not exist")
            continue
        if resource["value"] != len(rows) or resource["version"] != len(rows):
            report.add(
                "d", f"{name}: final value {resource['value']} / version "
                f"{resource['version']}, but {len(rows)} writes were recorded"
            )
        top = max((int(row["token"]) for row in rows), default=0)
        if rows and resource.get("fence_token") not in (None, top):
            report.add(
                "c", f"{name}: fence_token {resource['fence_token']}, highest written "
                f"token {top}"
            )


def check(
    *, lock_history: Iterable[Row], writes: Iterable[Row], resources: Mapping[str, Row],
    client: Iterable[Row], liveness: Mapping[str, float | None], volume: Volume,
    live_within: float,
) -> Report:
    """Run every check; the report lists each violation with its letter."""
    report = Report()
    leases = leases_from(lock_history, report)
    check_overlap(leases, report)
    ops = check_client(client, leases, report)
    check_writes(writes, resources, leases, ops, report)
    for name, waited in sorted(liveness.items()):
        if waited is None or waited > live_within:
            report.add("e", f"{name}: not acquirable within {live_within} s after healing "
                       f"(waited {waited})")
    short = [
        f"{what} {got} < {least}"
        for what, got, least in (
            ("grants", report.grants, volume.grants),
            ("writes", report.writes, volume.writes),
            ("stale writes refused", report.stale_refused, volume.stale_refused),
        )
        if got < least
    ]
    if short:
        report.add("e", "vacuous run: " + ", ".join(short))
    return report
