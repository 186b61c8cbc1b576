#!/usr/bin/env python
"""The async API against the sync API in threads, and against the two other ways it could
have been built, measured in the same run (issue 13).

    python benchmarks/async_api.py                     # full: 3 interleaved rounds, all backends
    python benchmarks/async_api.py --quick             # proves it runs (CI): 1 short round
    python benchmarks/async_api.py --quick --backends sqlite   # no server needed

Designs (benchmarks/async_designs.py): the sync API in threads; the async API as built
(every database operation through Django's thread-sensitive sync layer), in one event
loop and with a ThreadSensitiveContext per coroutine (what an ASGI request gets); the
same async code with a thread-*insensitive* sync layer (the loop's thread pool); and on
PostgreSQL a native psycopg ``AsyncConnection`` pool calling distlock's server functions.

Scenarios: **own** — every worker cycles acquire(blocking=False) + release on its own
name (1 worker, and many); **one name** — every worker takes the one contended name with
a *blocking* acquire (LISTEN/NOTIFY wake-ups on PostgreSQL, back-off polling elsewhere)
and releases it at once. Each measurement runs in a forked child: its workers warm up
together, meet, run for ``--seconds``; a cycle counts if it ended inside the window. Per
cycle it records the whole cycle (own) or the blocking acquire's wait-to-grant (one
name); the child's thread count is read from /proc/self/status twice in the window.
Rounds are interleaved, the design order rotated each round; every figure is the median
over rounds, and "× sync" is the ratio to the sync API in the same round (1 thread for
1 worker, ``--threads``' first count for many), median over rounds.

Its own databases, as benchmarks/run.py's (DISTLOCK_BENCH_POSTGRES / _MARIADB; SQLite a
temporary file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from time import perf_counter, process_time
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import async_designs as d  # noqa: E402
from benchmarks import databases as dbs  # noqa: E402
from benchmarks import run  # noqa: E402
from benchmarks.harness import jain, percentile  # noqa: E402

BACKENDS = ("postgresql", "mariadb", "sqlite")
TITLES = {"postgresql": "PostgreSQL", "mariadb": "MariaDB", "sqlite": "SQLite"}
OWN, ONE = "own", "one name"
# Where in the window the thread count is read (the last: the window's end, for the CPU).
SAMPLES = (0.5, 0.95, 1.0)


@dataclass
class Result:
    rate: float  # granted cycles per second, all workers
    p50_us: float  # own: one cycle (acquire + release); one name: wait-to-grant
    p99_us: float
    threads: int  # the process's threads, the most seen in the window
    jain: float  # fairness of grants over workers (1.0 = equal)
    cpu_us: float  # the process's CPU (user + system, all threads) per counted cycle


@dataclass
class Row:
    """One line of a table: a design at one worker count, and its results per scenario."""

    design: d.Design
    workers: int
    scenarios: tuple[str, ...]
    results: dict[str, list[Result]]

    @property
    def label(self) -> str:
        unit = "thread" if self.design.kind == "threads" else "coroutine"
        return f"{self.design.label}: {self.workers} {unit}{'s' if self.workers > 1 else ''}"


def _threads() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("no Threads: line in /proc/self/status")


def _name(scenario: str, index: int) -> str:
    return "contended" if scenario == ONE else f"own:{index}"


def _window(cycle: Any, scenario: str, end: float) -> tuple[list[float], int]:
    """Run ``cycle`` until ``end``: the latencies of the cycles that ended by then."""
    latencies: list[float] = []
    while True:
        began = perf_counter()
        granted = cycle()
        done = perf_counter()
        if done > end:
            return latencies, len(latencies)
        latencies.append((granted if scenario == ONE else done) - began)


def _summary(reports: list[tuple[list[float], int]], seconds: float, threads: int,
             cpu: float) -> Result:
    latencies = [x for got, _ in reports for x in got]
    if not latencies:
        raise RuntimeError("no cycle ended inside the window")
    return Result(
        rate=sum(n for _, n in reports) / seconds,
        p50_us=statistics.median(latencies) * 1e6,
        p99_us=percentile(latencies, 0.99) * 1e6,
        threads=threads,
        jain=jain([float(n) for _, n in reports]),
        cpu_us=cpu / max(1, sum(n for _, n in reports)) * 1e6,
    )


def in_threads(design: d.Design, scenario: str, workers: int, seconds: float,
               warmup: float) -> Result:
    from django.db import connections

    clock = {"end": 0.0}

    def begin() -> None:  # run once, when every worker has warmed up
        clock["end"] = perf_counter() + seconds

    barrier = threading.Barrier(workers + 1, timeout=300, action=begin)
    reports: list[Any] = [None] * workers

    def body(index: int) -> None:
        name, blocking = _name(scenario, index), scenario == ONE
        try:
            warm = perf_counter() + warmup
            while perf_counter() < warm:
                design.cycle(name, blocking)
            barrier.wait()
            reports[index] = _window(lambda: design.cycle(name, blocking), scenario,
                                     clock["end"])
        except BaseException:  # noqa: BLE001 - reported below, fails the run
            barrier.abort()
            reports[index] = traceback.format_exc()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    seen, cpu = 0, 0.0
    try:
        barrier.wait()
        cpu = -process_time()
        for at in SAMPLES:
            time.sleep(max(0.0, clock["end"] - seconds * (1 - at) - perf_counter()))
            seen = max(seen, _threads())
        cpu += process_time()
    except threading.BrokenBarrierError:
        pass
    for thread in threads:
        thread.join()
    failed = [r for r in reports if isinstance(r, str)]
    if failed:
        raise RuntimeError(failed[0])
    return _summary(reports, seconds, seen, cpu)


async def in_loop(design: d.Design, scenario: str, workers: int, seconds: float,
                  warmup: float) -> Result:
    ready, go = asyncio.Event(), asyncio.Event()
    arrived = 0
    clock = {"end": 0.0}

    async def body(index: int) -> tuple[list[float], int]:
        nonlocal arrived
        name, blocking = _name(scenario, index), scenario == ONE
        async with design.worker_context():
            warm = perf_counter() + warmup
            while perf_counter() < warm:
                await design.acycle(name, blocking)
            arrived += 1
            if arrived == workers:
                ready.set()
            await go.wait()
            latencies: list[float] = []
            while True:
                began = perf_counter()
                granted = await design.acycle(name, blocking)
                done = perf_counter()
                if done > clock["end"]:
                    return latencies, len(latencies)
                latencies.append((granted if scenario == ONE else done) - began)

    await design.start(workers)
    try:
        tasks = [asyncio.create_task(body(i)) for i in range(workers)]
        waiting = asyncio.create_task(ready.wait())
        await asyncio.wait([waiting, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():  # a worker failed during the warm-up
            await asyncio.gather(*tasks)
        clock["end"] = perf_counter() + seconds
        go.set()
        seen, cpu = 0, -process_time()
        for at in SAMPLES:
            await asyncio.sleep(max(0.0, clock["end"] - seconds * (1 - at) - perf_counter()))
            seen = max(seen, _threads())
        cpu += process_time()
        reports = await asyncio.gather(*tasks)
    finally:
        await design.stop()
    return _summary(list(reports), seconds, seen, cpu)


def _child(design: d.Design, scenario: str, workers: int, seconds: float, warmup: float,
           queue: Any) -> None:
    try:
        if design.kind == "threads":
            result = in_threads(design, scenario, workers, seconds, warmup)
        else:
            result = asyncio.run(in_loop(design, scenario, workers, seconds, warmup))
        queue.put(("ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        queue.put(("error", traceback.format_exc()))


def measure(row: Row, scenario: str, args: argparse.Namespace) -> Result:
    """One measurement in a forked child (its threads and connections are its own)."""
    from django.db import connections

    connections.close_all()  # forked children must not share the parent's sockets
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(
        row.design, scenario, row.workers, args.seconds, args.warmup, queue))
    child.start()
    try:
        kind, got = queue.get(timeout=args.seconds + args.warmup + 600)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join()
    if kind == "error":
        raise RuntimeError(f"{row.label} / {scenario}:\n{got}")
    return got


def build(backend: str, alias: str, args: argparse.Namespace) -> list[Row]:
    both = (OWN, ONE)
    one, many = args.threads
    rows = [Row(d.SyncThreads(alias), 1, (OWN,), {}),
            Row(d.SyncThreads(alias), one, both, {}),
            Row(d.SyncThreads(alias), many, both, {})]
    designs: list[d.Design] = [d.AsyncBuilt(alias), d.AsyncThreadPool(alias)]
    if backend == "postgresql":
        designs.append(d.NativePsycopg(alias, dbs.pg_conninfo()))
    for design in designs:
        rows.append(Row(design, 1, (OWN,), {}))
        rows.append(Row(design, args.coroutines, both, {}))
        if isinstance(design, d.AsyncBuilt) and not isinstance(design, d.AsyncThreadPool):
            rows.append(Row(d.AsyncPerRequest(alias), args.requests, both, {}))
    return rows


def reference(rows: list[Row], row: Row) -> Row:
    """The sync row that ``row`` is compared with: 1 thread for 1 worker, else the first
    --threads count."""
    want = 1 if row.workers == 1 else rows[1].workers
    return next(r for r in rows if isinstance(r.design, d.SyncThreads) and r.workers == want)


def ratio(rows: list[Row], row: Row, scenario: str) -> float:
    ref = reference(rows, row)
    pairs = zip(row.results[scenario], ref.results[scenario], strict=True)
    return statistics.median(mine.rate / theirs.rate for mine, theirs in pairs)


def _n(value: float) -> str:
    return f"{value:,.0f}"


def table(title: str, rows: list[Row]) -> str:
    head = [title, "own names: cycles/s", "× sync", "cycle p50 / p99 µs", "CPU µs/cycle",
            "threads",
            "one name: grants/s", "× sync", "wait-to-grant p50 / p99 µs", "Jain", "threads"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for row in rows:
        cells = [row.label]
        for scenario in (OWN, ONE):
            runs = row.results.get(scenario)
            if not runs:
                cells += ["–"] * 5
                continue
            cells += [_n(statistics.median(r.rate for r in runs)),
                      f"{ratio(rows, row, scenario):.2f}",
                      f"{_n(statistics.median(r.p50_us for r in runs))} / "
                      f"{_n(statistics.median(r.p99_us for r in runs))}"]
            cells.append(_n(statistics.median(r.cpu_us for r in runs)) if scenario == OWN
                         else f"{statistics.median(r.jain for r in runs):.2f}")
            cells.append(str(max(r.threads for r in runs)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def configure(backends: list[str], sqlite_path: str) -> None:
    """Django settings: the benchmark databases of benchmarks/databases.py, with a 30 s
    busy timeout on SQLite (the tests' and the demo's) instead of run.py's 5 s: 50
    connections writing one file outlast 5 s on a loaded 2-core machine."""

    databases: dict[str, Any] = {}
    if "postgresql" in backends:
        databases["default"] = dbs.pg_settings()
    if "mariadb" in backends:
        databases["mariadb"] = dbs.maria_settings()
    if "sqlite" in backends:
        sqlite = dbs.sqlite_settings(sqlite_path)
        databases["sqlite"] = {**sqlite, "OPTIONS": {**sqlite["OPTIONS"], "timeout": 30}}
    databases.setdefault("default", databases["sqlite"] if "sqlite" in databases
                         else next(iter(databases.values())))
    dbs.setup_django(databases)


def version(alias: str) -> str:
    from django.db import connections

    connection = connections[alias]
    with connection.cursor() as cursor:
        cursor.execute("SELECT sqlite_version()" if connection.vendor == "sqlite"
                       else "SELECT version()")
        found = str(cursor.fetchone()[0]).split(" on ")[0]
    host = connection.settings_dict.get("HOST") or "a local file"
    return f"{connection.vendor} {found} via {host}"


def _progress(text: str) -> None:
    print(f"  … {text}", file=sys.stderr, flush=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="one short round with small counts: proves the benchmark works")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated: postgresql,mariadb,sqlite (default: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--threads", default="8,50",
                        help="the sync API's two thread counts (default 8,50; each thread "
                        "holds a connection, and PostgreSQL's default max_connections is 100)")
    parser.add_argument("--coroutines", type=int, default=200,
                        help="coroutines of the many-coroutine rows (default 200)")
    parser.add_argument("--requests", type=int, default=50,
                        help="coroutines of the per-request-context row; each holds a "
                        "thread and a connection (default 50)")
    parser.add_argument("--json", help="also write every per-round result to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.warmup = 1, 0.3, 0.1
        args.threads, args.coroutines, args.requests = "2,4", 20, 4
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or set(backends) - set(BACKENDS):
        parser.error(f"--backends: choose from {', '.join(BACKENDS)}")
    try:
        args.threads = tuple(int(x) for x in args.threads.split(","))
    except ValueError:
        parser.error("--threads: two whole numbers, e.g. 8,50")
    if (len(args.threads) != 2 or min(args.threads) < 2 or args.coroutines < 2
            or args.requests < 2 or args.rounds < 1 or args.seconds <= 0):
        parser.error("need two --threads counts ≥ 2, --coroutines and --requests ≥ 2, "
                     "--rounds ≥ 1 and --seconds > 0")
    folder = tempfile.mkdtemp(prefix="distlock-async-bench-")
    started = time.monotonic()
    load_before = _load()
    try:
        configure(backends, str(Path(folder) / "bench.sqlite3"))
        aliases = {"postgresql": "default", "mariadb": "mariadb", "sqlite": "sqlite"}
        if "postgresql" in backends:
            dbs.create_pg()
        if "mariadb" in backends:
            dbs.create_maria()
        tables: dict[str, list[Row]] = {}
        for backend in backends:
            dbs.prepare(aliases[backend], dbs.POOL)
            tables[backend] = build(backend, aliases[backend], args)
        print("## distlock async API benchmark\n")
        print(f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} "
              f"CPUs, load average {load_before} at the start; Python "
              f"{platform.python_version()}")
        import django

        print(f"- Django {django.__version__}; {args.rounds} round(s), {args.seconds} s per "
              f"measurement after {args.warmup} s warm-up; medians over rounds; × sync = "
              f"ratio to the sync API in the same round (1 thread for 1 worker, "
              f"{args.threads[0]} threads for many), median over rounds")
        for backend in backends:
            print(f"- {TITLES[backend]}: {version(aliases[backend])}")
        print()
        for round_no in range(args.rounds):
            for backend in backends:
                for row in run.rotated(tables[backend], round_no):
                    for scenario in row.scenarios:
                        if not args.quick:
                            dbs.maintain(aliases[backend])
                        result = measure(row, scenario, args)
                        row.results.setdefault(scenario, []).append(result)
                        _progress(f"round {round_no + 1} {TITLES[backend]}: {row.label} "
                                  f"{scenario} {result.rate:,.0f}/s, {result.threads} threads")
        for backend in backends:
            print(table(TITLES[backend], tables[backend]) + "\n")
        print(f"({time.monotonic() - started:.0f} s; load average {_load()} at the end)")
        if args.json:
            dump = {TITLES[b]: {row.label: {sc: [asdict(r) for r in runs]
                                            for sc, runs in row.results.items()}
                                for row in rows} for b, rows in tables.items()}
            Path(args.json).write_text(json.dumps(dump, indent=1))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
