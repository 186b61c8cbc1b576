#!/usr/bin/env python
"""Many waiters on one name (PostgreSQL): hand-off against spinning, in one run.

    python benchmarks/waiters.py            # A spinning with 8, 8 and 64 blocking waiters
    python benchmarks/waiters.py --quick    # shorter rounds, 8 and 16 waiters

Each worker is a process that loops: take the one lock named "waited" (A: try-locks back to
back, the reference's spinning; distlock: a blocking ``acquire(timeout=…)``), hold it for
``--hold`` seconds, release. Per scenario it reports grants/s, wait-to-grant p50/p99 (the
call, or A's first refused try, to the grant), the longest wait, how many grants one other
worker got at most while a worker waited ("overtaken": 1 is first come, first served),
Jain's index of the grants per worker, how many grants went to the process that made
the release just before ("same process again": a re-grab needs no wake-up of another
process, which a fair hand-off never gets), wake-ups per release (every
``psycopg.Connection.notifies()`` item counted in each worker, and every waiter woken
because the one ahead of it left the queue), and the server's CPU per
grant (each worker's backend, from ``/proc/<pid>/stat``: run it on the database's own
machine). Its own database (``distlock_bench`` + ``--db-suffix``, default
``_waiters``): a run against an older distlock (``PYTHONPATH=<other tree>``) needs a
suffix of its own, since the migrations change the SQL functions.
"""

from __future__ import annotations

import argparse
import bisect
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import contenders as c  # noqa: E402
from benchmarks import databases as dbs  # noqa: E402
from benchmarks.harness import jain, percentile, reap  # noqa: E402
from tests.support import notifications  # noqa: E402

NAME = "waited"


def _worker(kind: str, index: int, hold: float, seconds: float, warmup: float,
            barrier: Any, queue: Any) -> None:
    # Here, not at the top: cpu_split imports run.py, which imports this module.
    from benchmarks.cpu_split import cpu_seconds

    try:
        notifications.count_notifications()
        if kind == "A":
            ref = c.PgUpsert(dbs.pg_conninfo(SUFFIX))
            ref.connect()
            pid = int(ref.conn.info.backend_pid)

            def take() -> Any:
                while (handle := ref.try_acquire(NAME)) is None:
                    pass
                return handle

            release = ref.release
        else:
            from django.db import connection

            from distlock import acquire

            connection.ensure_connection()
            pid = int(connection.connection.info.backend_pid)

            def take() -> Any:
                return acquire(NAME, ttl=30, timeout=60)

            def release(lease: Any) -> None:
                lease.release()

        def loop(until: float, record: list[tuple[float, float, float]] | None) -> None:
            while time.perf_counter() < until:
                began = time.perf_counter()
                handle = take()
                if handle is None:
                    raise RuntimeError("a blocking acquire timed out")
                got = time.perf_counter()
                if hold:
                    time.sleep(hold)
                release(handle)
                if record is not None:
                    record.append((began, got, time.perf_counter()))

        loop(time.perf_counter() + warmup, None)
        barrier.wait(timeout=300)
        notifications.reset()
        grants: list[tuple[float, float, float]] = []
        backend, cpu = cpu_seconds(pid), time.process_time()
        loop(time.perf_counter() + seconds, grants)
        queue.put((index, grants, notifications.wakeups(), cpu_seconds(pid) - backend,
                   time.process_time() - cpu))
    except BaseException as exc:  # noqa: BLE001 - the parent fails the run
        barrier.abort()
        queue.put((index, f"{type(exc).__name__}: {exc}", 0, 0.0, 0.0))


def measure(kind: str, procs: int, hold: float, seconds: float, warmup: float) -> dict[str, Any]:
    from django.db import connections

    connections.close_all()
    context = multiprocessing.get_context("fork")
    barrier, queue = context.Barrier(procs), context.Queue()
    workers = [context.Process(target=_worker, args=(kind, i, hold, seconds, warmup,
                                                     barrier, queue)) for i in range(procs)]
    for worker in workers:
        worker.start()
    try:
        reports = [queue.get(timeout=seconds + warmup + 300) for _ in workers]
    finally:
        reap(workers, 120)
    errors = [r[1] for r in reports if isinstance(r[1], str)]
    if errors:
        raise SystemExit(f"{kind} x{procs}: a worker failed: {errors[0]}")
    per_worker = {index: grants for index, grants, *_ in reports}
    granted = sorted(got for grants in per_worker.values() for _, got, _ in grants)
    total = len(granted)
    waits = [got - began for grants in per_worker.values() for began, got, _ in grants]
    # Release to the next grant (whoever got it): how long a freed lock stays idle, the
    # hand-off's latency, which the grant window must outlast.
    released = sorted(done for grants in per_worker.values() for _, _, done in grants)
    idle = [got - released[i - 1] for got in granted
            if (i := bisect.bisect_left(released, got)) > 0]
    # Who got each grant, in grant order: the share that went to the previous holder again.
    order = sorted((got, index) for index, grants in per_worker.items() for _, got, _ in grants)
    again = sum(a[1] == b[1] for a, b in zip(order, order[1:], strict=False))
    overtaken = 0
    for index, grants in per_worker.items():
        others = [sorted(got for _, got, _ in g) for i, g in per_worker.items() if i != index]
        for began, got, _ in grants:
            for times in others:
                served = bisect.bisect_left(times, got) - bisect.bisect_right(times, began)
                overtaken = max(overtaken, served)
    return {
        "rate": total / seconds,
        "p50_ms": percentile(waits, 0.5) * 1e3,
        "p99_ms": percentile(waits, 0.99) * 1e3,
        "max_ms": max(waits) * 1e3,
        "overtaken": overtaken,
        "again_pct": again / max(total - 1, 1) * 100,
        "idle_p99_ms": percentile(idle, 0.99) * 1e3 if idle else 0.0,
        "idle_max_ms": max(idle) * 1e3 if idle else 0.0,
        "jain": jain([float(len(g)) for g in per_worker.values()]),
        "wakeups": sum(r[2] for r in reports) / max(total, 1),
        "server_us": sum(r[3] for r in reports) / max(total, 1) * 1e6,
        "client_us": sum(r[4] for r in reports) / max(total, 1) * 1e6,
    }


def notify_cost(listeners: int, count: int = 1000) -> tuple[float, float]:
    """Server CPU µs per NOTIFY (listening sessions', the sender's) with ``listeners``
    sessions each LISTENing on a channel of its own, one of them notified. PostgreSQL
    (before 19) signals every listening backend of the database on each NOTIFY, and each
    reads the queue in a transaction of its own: the part of a hand-off that grows with
    the number of waiters although one client is woken."""
    import psycopg

    conninfo = dbs.pg_conninfo(SUFFIX)
    sessions = [psycopg.connect(conninfo, autocommit=True) for _ in range(listeners + 1)]
    try:
        sender, *listening = sessions
        for number, session in enumerate(listening):
            session.execute(f"LISTEN probe_{number}")
        pids = [session.info.backend_pid for session in listening]
        from benchmarks.cpu_split import cpu_seconds

        before, sent = sum(map(cpu_seconds, pids)), cpu_seconds(sender.info.backend_pid)
        for _ in range(count):
            sender.execute("SELECT pg_notify('probe_0', '')")
        time.sleep(1.0)  # the signalled backends read the queue after the sender returns
        return ((sum(map(cpu_seconds, pids)) - before) / count * 1e6,
                (cpu_seconds(sender.info.backend_pid) - sent) / count * 1e6)
    finally:
        for session in sessions:
            session.close()


def in_subprocess(*argv: str) -> None:
    """Run this benchmark in a process of its own (run.py's full run: its Django settings
    are configured already, with other databases)."""
    subprocess.run([sys.executable, __file__, *argv], check=True)


SUFFIX = "_waiters"
COLUMNS = ("grants/s", "× A", "wait p50 ms", "wait p99 ms", "max wait ms", "overtaken",
           "same process again %", "Jain", "wake-ups/release", "server CPU µs/grant",
           "client CPU µs/grant",
           "release→grant p99 / max ms")


def main(argv: list[str] | None = None) -> int:
    global SUFFIX
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 3 s; 8 and 16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--hold", type=float, default=0.0,
                        help="seconds each grant is held (default 0: release at once)")
    parser.add_argument("--many", type=int, default=64, help="waiters of the large scenario")
    parser.add_argument("--db-suffix", default=SUFFIX)
    parser.add_argument("--listening-waiters", type=int, default=None,
                        help="DISTLOCK_LISTENING_WAITERS (default: distlock's own default)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.many = 1, 3.0, 0.5, 16
    SUFFIX = args.db_suffix

    dbs.setup_django(
        {"default": dbs.pg_settings(SUFFIX)},
        **({} if args.listening_waiters is None
           else {"DISTLOCK_LISTENING_WAITERS": args.listening_waiters}),
    )
    dbs.create_pg(SUFFIX)
    dbs.prepare("default", 1)
    scenarios = [("A", 8), ("distlock", 8), ("distlock", args.many)]
    seen: dict[tuple[str, int], list[dict[str, Any]]] = {s: [] for s in scenarios}
    for round_no in range(args.rounds):
        for kind, procs in scenarios[round_no % 3:] + scenarios[:round_no % 3]:
            seen[(kind, procs)].append(measure(kind, procs, args.hold, args.seconds,
                                               args.warmup))
            print(f"round {round_no + 1}: {kind} x{procs} done", file=sys.stderr)
    load = os.getloadavg()
    print(f"One name, {args.rounds} round(s) of {args.seconds} s, hold {args.hold * 1e3:g} ms, "
          f"medians; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; "
          f"distlock from {Path(sys.modules['distlock'].__file__ or '').parent}"
          + ("" if args.listening_waiters is None
             else f", DISTLOCK_LISTENING_WAITERS = {args.listening_waiters}") + "\n")
    print("| scenario | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    ref = seen[("A", 8)]
    for (kind, procs), runs in seen.items():
        label = "A, spinning try-locks" if kind == "A" else "distlock, blocking acquire"

        def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        vs_a = statistics.median(r["rate"] / a["rate"] for r, a in zip(runs, ref, strict=True))
        print(f"| {label}, {procs} processes | {med('rate'):,.0f} | {vs_a:.2f} | "
              f"{med('p50_ms'):.1f} | {med('p99_ms'):.1f} | {med('max_ms'):.0f} | "
              f"{med('overtaken'):.0f} | {med('again_pct'):.0f} | {med('jain'):.3f} | "
              f"{med('wakeups'):.2f} | "
              f"{med('server_us'):.0f} | {med('client_us'):.0f} | "
              f"{med('idle_p99_ms'):.1f} / {med('idle_max_ms'):.0f} |")
    print("\nNOTIFY's own server CPU (µs per NOTIFY), by listening sessions:")
    for listeners in (1, 8, args.many):
        woken, sender = notify_cost(listeners)
        print(f"- {listeners} listening: theirs {woken:.0f}, the sender's {sender:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
