#!/usr/bin/env python
"""What limits a fair hand-off's grants/s on one PostgreSQL name, measured beside A.

    python benchmarks/handoff_limit.py                     # 3 rounds of 6 s, 8 processes
    python benchmarks/handoff_limit.py --quick             # 1 round of 3 s
    python benchmarks/handoff_limit.py --transport socket  # over the Unix socket
    python benchmarks/handoff_limit.py --waits             # + what the sessions wait for

Issue 15 asks distlock's blocking acquire (8 processes, one name) for the grants/s of A,
8 processes spinning with try-locks. A is not fair: a process that has just released
often takes the lock straight back, with no other process to wake. A fair hand-off
always wakes another process. This script measures, in one run, what that costs:

- ``A``: benchmarks/waiters.py's reference, try-locks back to back; per grant also whether
  the process that released just before got it again ("same process again").
- ``distlock``: ``acquire(timeout=60)``, as in waiters.py; ``distlock stamped``: the same
  with each of distlock's statements (``db.run_on``) and its wait for the NOTIFY timed in
  the worker, the methods wrapped there (distlock itself unchanged), for the breakdown.
- ``advisory``: ``pg_advisory_lock`` / ``pg_advisory_unlock`` at session level.
  PostgreSQL's lock manager queues waiters first come, first served and wakes the first
  one at the unlock: a fair hand-off through the server with no row and no commit, the
  floor of any hand-off through PostgreSQL.
- ``direct``: the best fair protocol with a lock row that this script could write: a row
  and a queue table; an acquire takes the free row or queues (one statement), and the
  release hands the row to the oldest waiter in its own transaction and NOTIFYs it with
  the token. The waiter owns the lock when the notification comes: one commit and one
  wake-up per grant. No expiry, no dead waiters: a lower bound, not a lock to use.
- ``claim``: distlock's shape: the release only reserves the row for the oldest waiter
  and NOTIFYs it; the woken waiter's own statement takes it (release commit -> NOTIFY ->
  waiter's acquire commit). Also a lower bound (no grant window, no liveness checks).

In both, joining the queue writes only to an unlogged table and takes no row lock, so it
waits for no WAL flush (a commit that wrote WAL waits for its flush: pg_stat_wal's syncs
per grant are reported, which is why the script wants a PostgreSQL server of its own:
``DISTLOCK_BENCH_POSTGRES=postgresql://…:5499/distlock_bench``).

Per scenario: grants/s, wait-to-grant p50/p99, Jain, "overtaken" (as in waiters.py),
release -> next grant in another process, the machine's CPU use (/proc/stat) and the
server CPU per grant; and, for each grant that went to another process, its critical
path from CLOCK_MONOTONIC stamps taken in the workers (``time.perf_counter`` on Linux,
one clock for all processes): the release call, release returned -> waiter woken,
woken -> its claim sent, the claim statement, claim -> the acquire call returns, and the
new holder's way to its own release. Then the floors with nothing else running: a round
trip (SELECT 1), a commit (a one-row UPDATE), and one NOTIFY wake-up across processes.
Its own database (``distlock_bench`` + ``--db-suffix``, default ``_limit``).
"""

from __future__ import annotations

import argparse
import bisect
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import contenders as c  # noqa: E402
from benchmarks import databases as dbs  # noqa: E402
from benchmarks.harness import jain, percentile, reap  # noqa: E402

NAME = "waited"
KEY = 7_115_115  # the advisory scenario's lock key
NAN = math.nan
KINDS = ("A", "distlock", "distlock stamped", "advisory", "direct", "claim")

SCHEMA = """
CREATE TABLE IF NOT EXISTS hl_lock (
    name text PRIMARY KEY, owner text NOT NULL DEFAULT '',
    token bigint NOT NULL DEFAULT 0, reserved text NOT NULL DEFAULT '');
-- Unlogged, as distlock_waiter is: joining and leaving the queue wait for no WAL flush.
CREATE UNLOGGED TABLE IF NOT EXISTS hl_waiter (
    id bigserial PRIMARY KEY, name text NOT NULL, owner text NOT NULL,
    channel text NOT NULL);
CREATE INDEX IF NOT EXISTS hl_waiter_name_id ON hl_waiter (name, id);
CREATE TABLE IF NOT EXISTS hl_floor (id int PRIMARY KEY, n bigint NOT NULL);
INSERT INTO hl_floor VALUES (1, 0) ON CONFLICT DO NOTHING;
INSERT INTO hl_lock (name) VALUES ('waited') ON CONFLICT DO NOTHING;

-- Take the free row or join the queue, in one statement. Acquires and releases of a name
-- take one advisory lock first, so they never miss each other (a free row has an empty
-- queue: a release with waiters hands the row on). Not the row lock: a locking read
-- writes WAL, so joining the queue would wait for a WAL flush.
CREATE OR REPLACE FUNCTION hl_acquire(p_name text, p_owner text, p_channel text)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE r hl_lock%ROWTYPE;
BEGIN
    PERFORM pg_advisory_xact_lock(7115116, hashtext(p_name));
    SELECT * INTO r FROM hl_lock WHERE name = p_name;
    IF r.owner = '' AND r.reserved = '' THEN
        UPDATE hl_lock SET owner = p_owner, token = r.token + 1 WHERE name = p_name;
        RETURN r.token + 1;
    END IF;
    INSERT INTO hl_waiter (name, owner, channel) VALUES (p_name, p_owner, p_channel);
    RETURN 0;
END $$;

-- Release: the oldest waiter leaves the queue and, if p_direct, gets the row now (the
-- notification carries the token); else the row is reserved for it and it takes it with
-- its own statement (the claim).
CREATE OR REPLACE FUNCTION hl_release(p_name text, p_owner text, p_direct boolean)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE t bigint; w hl_waiter%ROWTYPE;
BEGIN
    PERFORM pg_advisory_xact_lock(7115116, hashtext(p_name));
    SELECT token INTO t FROM hl_lock WHERE name = p_name AND owner = p_owner;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'hl_release: % does not hold %', p_owner, p_name;
    END IF;
    DELETE FROM hl_waiter WHERE id = (
        SELECT id FROM hl_waiter WHERE name = p_name ORDER BY id LIMIT 1
    ) RETURNING * INTO w;
    IF w.id IS NULL THEN
        UPDATE hl_lock SET owner = '' WHERE name = p_name;
    ELSIF p_direct THEN
        UPDATE hl_lock SET owner = w.owner, token = t + 1 WHERE name = p_name;
        PERFORM pg_notify(w.channel, (t + 1)::text);
    ELSE
        UPDATE hl_lock SET owner = '', reserved = w.owner WHERE name = p_name;
        PERFORM pg_notify(w.channel, '');
    END IF;
END $$;
"""
CLAIM = ("UPDATE hl_lock SET owner = reserved, reserved = '', token = token + 1 "
         "WHERE name = %s AND reserved = %s RETURNING token")

# One grant: who, and the stamps (perf_counter seconds; NaN where a kind has none).
FIELDS = ("index", "began", "woken", "claim_start", "claim_end", "leave_start", "leave_end",
          "got", "rel_start", "rel_end", "rel_stmt_start", "rel_stmt_end")


class Taker:
    """One kind's take and release, with the stamps of the grant just taken."""

    def __init__(self, kind: str, index: int, conninfo: str) -> None:
        self.kind, self.index = kind, index
        self.stamps: dict[str, float] = {}
        self.events: list[tuple[str, float, float]] = []
        self.owner, self.channel = f"p{index}", f"hl_w{index}"
        if kind.startswith("distlock"):
            from django.db import connection

            connection.ensure_connection()
            self.pid = int(connection.connection.info.backend_pid)
            if kind == "distlock stamped":
                self._stamp_distlock()
            return
        if kind == "A":
            self.ref = c.PgUpsert(conninfo)
            self.ref.connect()
            self.conn = self.ref.conn
        else:
            import psycopg

            self.conn = psycopg.connect(conninfo, autocommit=True)
            self.conn.execute(f"LISTEN {self.channel}")
        self.cur = self.conn.cursor()
        self.pid = int(self.conn.info.backend_pid)

    def _stamp_distlock(self) -> None:
        """Time each of distlock's statements and its waits for the NOTIFY in this process:
        the real functions run, wrapped (as tests/support/notifications.py counts them)."""
        from distlock import db
        from distlock.backends.postgresql import PostgreSQL

        events, run_on, handoff = self.events, db.run_on, PostgreSQL.wait_for_handoff

        def run_stamped(connection: Any, backend: Any, operation: str, *args: Any) -> Any:
            start = time.perf_counter()
            try:
                return run_on(connection, backend, operation, *args)
            finally:
                events.append((operation, start, time.perf_counter()))

        def handoff_stamped(self: Any, *args: Any) -> bool:
            start = time.perf_counter()
            came = handoff(self, *args)
            events.append(("notified" if came else "timed out", start, time.perf_counter()))
            return came

        db.run_on = run_stamped  # type: ignore[assignment]
        PostgreSQL.wait_for_handoff = handoff_stamped  # type: ignore[method-assign]

    def _notified(self) -> str:
        for notify in self.conn.notifies(timeout=30, stop_after=1):
            return notify.payload
        raise RuntimeError(f"{self.kind}: no hand-off within 30 s")

    def take(self) -> Any:
        s = self.stamps = {"began": time.perf_counter()}
        kind = self.kind
        if kind == "A":
            while True:
                s["claim_start"] = time.perf_counter()
                if (handle := self.ref.try_acquire(NAME)) is not None:
                    s["claim_end"] = time.perf_counter()
                    s["woken"] = s["claim_start"]  # no wake-up: the try that won
                    return handle
        if kind == "advisory":
            self.cur.execute("SELECT pg_advisory_lock(%s)", (KEY,))
            # The lock manager grants it before the waiter runs: woken with the grant.
            s["woken"] = s["claim_start"] = s["claim_end"] = time.perf_counter()
            return KEY
        if kind in ("direct", "claim"):
            s["claim_start"] = s["began"]
            token = self.cur.execute("SELECT hl_acquire(%s, %s, %s)",
                                     (NAME, self.owner, self.channel)).fetchone()[0]
            if token:
                s["claim_end"] = time.perf_counter()
                return token
            payload = self._notified()
            s["woken"] = time.perf_counter()
            if kind == "direct":
                s["claim_start"] = s["claim_end"] = s["woken"]
                return int(payload)
            s["claim_start"] = time.perf_counter()
            row = self.cur.execute(CLAIM, (NAME, self.owner)).fetchone()
            s["claim_end"] = time.perf_counter()
            if row is None:
                raise RuntimeError("claim: notified, but the row was not reserved for it")
            return row[0]
        from distlock import acquire

        self.events.clear()
        lease = acquire(NAME, ttl=30, timeout=60)
        if lease is None:
            raise RuntimeError("a blocking acquire timed out")
        if kind == "distlock stamped":
            self._read_events()
        return lease

    def _read_events(self) -> None:
        """The acquire's statements: its granted try is the claim, the wake-up is the
        last wait that ended before it (the NOTIFY, the queue's follow or the enqueue)."""
        s, events = self.stamps, self.events
        claims = [e for e in events if e[0] in ("acquire_existing", "acquire_new")]
        if not claims:
            return
        _, s["claim_start"], s["claim_end"] = claims[-1]
        wakes = [e for e in events if e[0] in ("notified", "follow", "enqueue")
                 and e[2] <= s["claim_start"]]
        if wakes:
            s["woken"] = wakes[-1][2]
            s["path"] = float(("notified", "follow", "enqueue").index(wakes[-1][0]))
        leaves = [e for e in events if e[0] == "leave" and e[1] >= s["claim_end"]]
        if leaves:
            _, s["leave_start"], s["leave_end"] = leaves[-1]

    def release(self, handle: Any) -> None:
        s = self.stamps
        s["rel_start"] = time.perf_counter()
        if self.kind == "A":
            self.ref.release(handle)
        elif self.kind == "advisory":
            self.cur.execute("SELECT pg_advisory_unlock(%s)", (KEY,))
        elif self.kind in ("direct", "claim"):
            self.cur.execute("SELECT hl_release(%s, %s, %s)",
                             (NAME, self.owner, self.kind == "direct"))
        else:
            self.events.clear()
            handle.release()
            if self.kind == "distlock stamped":
                for name, start, end in self.events:
                    if name == "release":
                        s["rel_stmt_start"], s["rel_stmt_end"] = start, end
        s["rel_end"] = time.perf_counter()

    def record(self) -> tuple[float, ...]:
        s = self.stamps
        return (float(self.index), *(s.get(f, NAN) for f in FIELDS[1:]), s.get("path", NAN))


def _worker(kind: str, index: int, conninfo: str, seconds: float, warmup: float,
            barrier: Any, queue: Any) -> None:
    from benchmarks.cpu_split import cpu_seconds

    try:
        taker = Taker(kind, index, conninfo)

        def loop(until: float, out: list[tuple[float, ...]] | None) -> int:
            done = 0
            while time.perf_counter() < until:
                handle = taker.take()
                taker.stamps["got"] = time.perf_counter()
                taker.release(handle)
                done += 1
                if out is not None:
                    out.append(taker.record())
            return done

        warm = loop(time.perf_counter() + warmup, None)
        barrier.wait(timeout=300)
        grants: list[tuple[float, ...]] = []
        backend, cpu = cpu_seconds(taker.pid), time.process_time()
        loop(time.perf_counter() + seconds, grants)
        queue.put((index, grants, cpu_seconds(taker.pid) - backend, time.process_time() - cpu,
                   warm, taker.pid))
    except BaseException as exc:  # noqa: BLE001 - the parent fails the run
        barrier.abort()
        queue.put((index, f"{type(exc).__name__}: {exc}", 0.0, 0.0, 0, 0))


def _cpu_busy() -> tuple[int, int]:
    """The machine's busy and total jiffies so far (/proc/stat's first line)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def _reset(conninfo: str) -> None:
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("DELETE FROM hl_waiter")
        conn.execute("UPDATE hl_lock SET owner = '', reserved = ''")
        conn.execute("VACUUM hl_lock, hl_waiter, bench_lock, distlock_lock")
        conn.execute("CHECKPOINT")


def _wal(conninfo: str, pids: list[int] | None = None) -> tuple[int, int]:
    """The server's WAL syncs and records so far (pg_stat_wal: the whole server, so only
    a server of the benchmark's own counts this run alone), once the backends ``pids``
    have exited (a backend adds its counts when it exits)."""
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        deadline = time.monotonic() + 30
        while pids and time.monotonic() < deadline and conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
        ).fetchone()[0]:
            time.sleep(0.05)
        conn.execute("SELECT pg_stat_force_next_flush()")
        syncs, records = conn.execute("SELECT wal_sync, wal_records FROM pg_stat_wal").fetchone()
        return int(syncs), int(records)


# The statement a session runs, by the function or table it names (pg_stat_activity).
_SAMPLE = (
    "SELECT substring(query from '(distlock_[a-z]+|hl_[a-z]+|INSERT INTO bench_lock|"
    "UPDATE bench_lock|UPDATE hl_lock|pg_advisory_[a-z]+)'), "
    "coalesce(wait_event_type, 'CPU') || ':' || coalesce(wait_event, '-') "
    "FROM pg_stat_activity WHERE datname = current_database() AND state = 'active' "
    "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
)


def _sample(conninfo: str, seconds: float) -> dict[str, dict[str, int]]:
    """What the database's active sessions wait for, sampled about every ms for
    ``seconds``: per statement, the samples of each wait event ("CPU:-": none)."""
    import psycopg

    seen: dict[str, dict[str, int]] = {}
    with psycopg.connect(conninfo, autocommit=True) as conn:
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            for statement, wait in conn.execute(_SAMPLE).fetchall():
                waits = seen.setdefault(statement or "other", {})
                waits[wait] = waits.get(wait, 0) + 1
            time.sleep(0.001)
    return seen


def measure(kind: str, procs: int, conninfo: str, seconds: float,
            warmup: float, sample: bool = False) -> dict[str, Any]:
    from django.db import connections

    connections.close_all()
    _reset(conninfo)
    syncs, records = _wal(conninfo)
    context = multiprocessing.get_context("fork")
    barrier, queue = context.Barrier(procs + 1), context.Queue()
    workers = [context.Process(target=_worker, args=(kind, i, conninfo, seconds, warmup,
                                                     barrier, queue)) for i in range(procs)]
    for worker in workers:
        worker.start()
    try:
        barrier.wait(timeout=300)
        busy, total = _cpu_busy()
        waits = _sample(conninfo, seconds) if sample else {}
        if not sample:
            time.sleep(seconds)
        busy_end, total_end = _cpu_busy()
        reports = [queue.get(timeout=seconds + 300) for _ in workers]
    finally:
        reap(workers, 120)
    errors = [r[1] for r in reports if isinstance(r[1], str)]
    if errors:
        raise SystemExit(f"{kind} x{procs}: a worker failed: {errors[0]}")
    syncs_end, records_end = _wal(conninfo, [r[5] for r in reports])
    result = summarize([g for r in reports for g in r[1]], procs, seconds)
    # Over the workers' whole lives (warm-up, measured, the last grants): their grants.
    everything = result["grants"] + sum(r[4] for r in reports)
    result["wal_syncs"] = (syncs_end - syncs) / max(everything, 1)
    result["wal_records"] = (records_end - records) / max(everything, 1)
    result["waits"] = waits
    result["cpu_busy_pct"] = (busy_end - busy) / max(total_end - total, 1) * 100
    result["server_us"] = sum(r[2] for r in reports) / max(result["grants"], 1) * 1e6
    result["client_us"] = sum(r[3] for r in reports) / max(result["grants"], 1) * 1e6
    return result


def _med(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) * 1e6 if values else NAN


def summarize(grants: list[tuple[float, ...]], procs: int, seconds: float) -> dict[str, Any]:
    """The figures of one measurement from every grant's stamps (µs unless named)."""
    f = {name: i for i, name in enumerate((*FIELDS, "path"))}
    order = sorted(grants, key=lambda g: g[f["got"]])
    waits = [g[f["got"]] - g[f["began"]] for g in order]
    per_worker: dict[int, list[float]] = {}
    for g in order:
        per_worker.setdefault(int(g[f["index"]]), []).append(g[f["got"]])
    overtaken = 0
    for index in per_worker:
        others = [t for i, t in per_worker.items() if i != index]
        for g in order:
            if int(g[f["index"]]) != index:
                continue
            for other in others:
                served = (bisect.bisect_left(other, g[f["got"]])
                          - bisect.bisect_right(other, g[f["began"]]))
                overtaken = max(overtaken, served)
    pairs = list(zip(order, order[1:], strict=False))
    again = sum(p[f["index"]] == g[f["index"]] for p, g in pairs)
    cross = [(p, g) for p, g in pairs if p[f["index"]] != g[f["index"]]]

    def part(start: tuple[str, str], end: tuple[str, str]) -> float:
        """Median over the grants to another process of end - start: each a (grant,
        field) pair, the grant "p" (the one before) or "g" (this one)."""
        return _med([(g if end[0] == "g" else p)[f[end[1]]]
                     - (g if start[0] == "g" else p)[f[start[1]]] for p, g in cross])

    paths = [g[f["path"]] for _, g in cross if not math.isnan(g[f["path"]])]
    handoff = [g[f["got"]] - p[f["rel_end"]] for p, g in cross]
    return {
        "grants": len(order),
        "rate": len(order) / seconds,
        "p50_ms": percentile(waits, 0.5) * 1e3,
        "p99_ms": percentile(waits, 0.99) * 1e3,
        "overtaken": overtaken,
        "jain": jain([float(len(t)) for t in per_worker.values()]
                     + [0.0] * (procs - len(per_worker))),
        "again_pct": again / max(len(pairs), 1) * 100,
        "handoff_p50_us": percentile(handoff, 0.5) * 1e6 if handoff else NAN,
        "handoff_p99_us": percentile(handoff, 0.99) * 1e6 if handoff else NAN,
        "notified_pct": (paths.count(0.0) / len(paths) * 100) if paths else NAN,
        # The critical path of a grant to another process, medians.
        "release_us": part(("p", "rel_start"), ("p", "rel_end")),
        "release_stmt_us": part(("p", "rel_stmt_start"), ("p", "rel_stmt_end")),
        "deliver_us": part(("p", "rel_end"), ("g", "woken")),
        "to_claim_us": part(("g", "woken"), ("g", "claim_start")),
        "claim_us": part(("g", "claim_start"), ("g", "claim_end")),
        "after_claim_us": part(("g", "claim_end"), ("g", "got")),
        "leave_us": part(("g", "leave_start"), ("g", "leave_end")),
        "to_release_us": part(("g", "got"), ("g", "rel_start")),
        "cycle_us": part(("p", "rel_start"), ("g", "rel_start")),
    }


def _percentiles(values: list[float]) -> str:
    return f"{percentile(values, 0.5) * 1e6:,.0f} / {percentile(values, 0.99) * 1e6:,.0f}"


def _listener(conninfo: str, ready: Any, heard: Any) -> None:
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("LISTEN hl_probe")
        ready.set()
        for notify in conn.notifies(timeout=120):
            if notify.payload == "stop":
                return
            heard.put(time.perf_counter())


def floors(conninfo: str, count: int) -> list[tuple[str, str]]:
    """p50 / p99 µs, nothing else running: a round trip, a commit, one NOTIFY wake-up."""
    import psycopg

    def timed(run: Callable[[], Any]) -> list[float]:
        for _ in range(50):
            run()
        out = []
        for _ in range(count):
            start = time.perf_counter()
            run()
            out.append(time.perf_counter() - start)
        return out

    rows: list[tuple[str, str]] = []
    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows.append(("round trip: SELECT 1",
                     _percentiles(timed(lambda: conn.execute("SELECT 1").fetchone()))))
        rows.append(("commit: a one-row UPDATE, autocommit", _percentiles(timed(
            lambda: conn.execute("UPDATE hl_floor SET n = n + 1 WHERE id = 1")))))
        context = multiprocessing.get_context("fork")
        ready, heard = context.Event(), context.Queue()
        listener = context.Process(target=_listener, args=(conninfo, ready, heard))
        listener.start()
        try:
            if not ready.wait(30):
                raise SystemExit("the NOTIFY listener did not start")
            sent, after_return = [], []
            for number in range(count + 50):
                start = time.perf_counter()
                conn.execute("SELECT pg_notify('hl_probe', '')")
                returned = time.perf_counter()
                woken = heard.get(timeout=30)
                if number >= 50:
                    sent.append(woken - start)
                    after_return.append(woken - returned)
            conn.execute("SELECT pg_notify('hl_probe', 'stop')")
        finally:
            reap([listener], 30)
        rows.append(("NOTIFY: sender's statement start -> listener's client has it",
                     _percentiles(sent)))
        rows.append(("NOTIFY: sender's statement returned -> listener's client has it",
                     _percentiles(after_return)))
    return rows


def _fmt(value: float, spec: str = ",.0f") -> str:
    return "–" if math.isnan(value) else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 3 s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated, of {', '.join(KINDS)}; A always runs")
    parser.add_argument("--transport", choices=dbs.TRANSPORTS, default="tcp")
    parser.add_argument("--floor-count", type=int, default=2000)
    parser.add_argument("--db-suffix", default="_limit")
    parser.add_argument("--waits", action="store_true",
                        help="sample pg_stat_activity's wait events during each measurement")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.floor_count = 1, 3.0, 0.5, 500
    kinds = ["A", *(k.strip() for k in args.kinds.split(",") if k.strip() not in ("A", ""))]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds: {', '.join(sorted(unknown))}")

    dbs.setup_django({"default": dbs.pg_settings(args.db_suffix, args.transport)})
    dbs.create_pg(args.db_suffix)
    dbs.prepare("default", 1)
    conninfo = dbs.pg_conninfo(args.db_suffix, args.transport)
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(SCHEMA)
    start_load = os.getloadavg()
    seen: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for round_no in range(args.rounds):
        shift = round_no % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            seen[kind].append(measure(kind, args.procs, conninfo, args.seconds, args.warmup,
                                      args.waits))
            print(f"round {round_no + 1}: {kind} done, load {os.getloadavg()[0]:.1f}",
                  file=sys.stderr)
    end_load = os.getloadavg()
    floor_rows = floors(conninfo, args.floor_count)
    ref = seen["A"]

    def med(runs: list[dict[str, Any]], key: str) -> float:
        values = [r[key] for r in runs if not math.isnan(r[key])]
        return statistics.median(values) if values else NAN

    print(f"One name, {args.procs} processes, PostgreSQL over {args.transport}, "
          f"{args.rounds} round(s) of {args.seconds:g} s, medians over rounds; load "
          f"average {start_load[0]:.1f} {start_load[1]:.1f} {start_load[2]:.1f} at the "
          f"start, {end_load[0]:.1f} {end_load[1]:.1f} {end_load[2]:.1f} at the end; "
          f"distlock from {Path(sys.modules['distlock'].__file__ or '').parent}\n")
    print("| scenario | grants/s | × A | wait p50 / p99 ms | overtaken | Jain "
          "| same process again % | release → grant elsewhere p50 / p99 µs "
          "| machine CPU busy % | server CPU µs/grant | client CPU µs/grant "
          "| WAL syncs / grant | WAL records / grant |")
    print("|---|" + "---:|" * 12)
    for kind, runs in seen.items():
        ratio = statistics.median(r["rate"] / a["rate"] for r, a in zip(runs, ref, strict=True))
        print(f"| {kind} | {med(runs, 'rate'):,.0f} | {ratio:.2f} "
              f"| {med(runs, 'p50_ms'):.1f} / {med(runs, 'p99_ms'):.1f} "
              f"| {med(runs, 'overtaken'):.0f} | {med(runs, 'jain'):.3f} "
              f"| {med(runs, 'again_pct'):.0f} | {_fmt(med(runs, 'handoff_p50_us'))} / "
              f"{_fmt(med(runs, 'handoff_p99_us'))} | {med(runs, 'cpu_busy_pct'):.0f} "
              f"| {med(runs, 'server_us'):,.0f} | {med(runs, 'client_us'):,.0f} "
              f"| {med(runs, 'wal_syncs'):.2f} | {med(runs, 'wal_records'):.1f} |")
    print("\nCritical path of a grant to another process (µs, medians of the grants, then "
          "over rounds): the holder's release call, its return -> the waiter woken (the "
          "NOTIFY; A: its next try sent), woken -> claim sent, the claim (the statement that "
          "took the lock), claim -> the acquire call returned (distlock: the queue's leave "
          "and the lease), the new holder's way to its own release call; their sum, the "
          "median release-to-release cycle, and 1 s / grants/s.\n")
    print("| scenario | release call (its statement) | release → woken | woken → claim "
          "| claim | claim → returned (leave) | → release | sum | median cycle "
          "| 1 s / grants/s | woken by NOTIFY % |")
    print("|---|" + "---:|" * 10)
    keys = ("release_us", "deliver_us", "to_claim_us", "claim_us", "after_claim_us",
            "to_release_us")
    for kind, runs in seen.items():
        parts = [med(runs, key) for key in keys]
        total = sum(p for p in parts if not math.isnan(p))
        stmt, leave = med(runs, "release_stmt_us"), med(runs, "leave_us")
        release = _fmt(parts[0]) + ("" if math.isnan(stmt) else f" ({_fmt(stmt)})")
        after = _fmt(parts[4]) + ("" if math.isnan(leave) else f" ({_fmt(leave)})")
        print(f"| {kind} | {release} | {_fmt(parts[1])} | {_fmt(parts[2])} "
              f"| {_fmt(parts[3])} | {after} | {_fmt(parts[5])} | {total:,.0f} "
              f"| {_fmt(med(runs, 'cycle_us'))} | {1e6 / med(runs, 'rate'):,.0f} "
              f"| {_fmt(med(runs, 'notified_pct'))} |")
    if args.waits:
        print("\nWhat the active sessions waited for (pg_stat_activity sampled about every "
              "ms, all rounds; per statement its samples, and each wait event's share of "
              "them when ≥ 5 %):\n")
        for kind, runs in seen.items():
            merged: dict[str, dict[str, int]] = {}
            for r in runs:
                for statement, waits in r["waits"].items():
                    into = merged.setdefault(statement, {})
                    for wait, n in waits.items():
                        into[wait] = into.get(wait, 0) + n
            for statement, waits in sorted(merged.items()):
                total = sum(waits.values())
                if total < 20:
                    continue
                shares = ", ".join(f"{wait} {n / total * 100:.0f} %" for wait, n in
                                   sorted(waits.items(), key=lambda kv: -kv[1])
                                   if n >= total * 0.05)
                print(f"- {kind}, {statement} ({total:,} samples): {shares}")
    print(f"\nFloors: this script's sessions alone on the database, after the scenarios "
          f"({args.floor_count} each, p50 / p99 µs; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}):\n")
    for label, figures in floor_rows:
        print(f"- {label}: {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
