#!/usr/bin/env python
"""Semaphore acquire + release cycles per second with 8 processes, beside the plain lock
in the same run (issue 29).

    python benchmarks/semaphore.py                         # PostgreSQL, 3 rounds of 6 s
    python benchmarks/semaphore.py --backend mariadb --rounds 5
    python benchmarks/semaphore.py --quick                 # 1 round of 2 s: a smoke test

Each of ``--processes`` forked processes (8) runs cycles for ``--seconds``: a blocking
``acquire_permit(name, permits=N, timeout=10)`` then ``release()`` — or, for the plain
lock, ``acquire(name, timeout=10)`` and ``release()`` — of one name, as a user waits
(back-off between refused tries). A round runs every variant once, in an order that
turns each round (interleaved, so a change of the machine's load falls on all of them);
the table gives each variant's cycles/s per round and their median. Its own database
``distlock_bench_semaphore`` (PostgreSQL/MariaDB; SQLite: a temporary file). Not part of
.ci/run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import databases as dbs  # noqa: E402

BACKENDS = ("postgresql", "mariadb", "sqlite")
#: (label, permits): None is the plain lock.
VARIANTS: tuple[tuple[str, int | None], ...] = (
    ("plain lock", None), ("N=1", 1), ("N=4", 4), ("N=8", 8),
)
TTL = 30.0


def configure(backend: str, folder: str) -> None:
    name = "distlock_bench_semaphore"
    if backend == "postgresql":
        dbs.create_pg(name=name)
        database = {**dbs.pg_settings(), "NAME": name}
    elif backend == "mariadb":
        dbs.create_maria(name=name)
        database = {**dbs.maria_settings(), "NAME": name}
    else:
        database = dbs.sqlite_settings(f"{folder}/semaphore.sqlite3")
    dbs.setup_django({"default": database})
    from django.core.management import call_command

    call_command("migrate", "distlock", verbosity=0)


def worker(label: str, permits: int | None, seconds: float, start: Any, out: Any) -> None:
    from django.db import connections

    from distlock import acquire, acquire_permit

    connections["default"].ensure_connection()
    name = f"bench:{label}"
    start.wait()
    cycles = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if permits is None:
            lease = acquire(name, ttl=TTL, timeout=10)
        else:
            lease = acquire_permit(name, permits=permits, ttl=TTL, timeout=10)
        assert lease is not None
        lease.release()
        cycles += 1
    connections.close_all()
    out.put(cycles)


def one_run(label: str, permits: int | None, processes: int, seconds: float) -> float:
    """Cycles per second of ``processes`` processes on one variant."""
    from django.db import connections

    connections.close_all()  # forked children open their own
    context = multiprocessing.get_context("fork")
    start, out = context.Event(), context.Queue()
    children = [
        context.Process(target=worker, args=(label, permits, seconds, start, out))
        for _ in range(processes)
    ]
    for child in children:
        child.start()
    time.sleep(1.0)  # the children connect before the clock starts
    start.set()
    total = sum(out.get(timeout=seconds + 120) for _ in children)
    for child in children:
        child.join(timeout=30)
    return total / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="postgresql", choices=BACKENDS)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--quick", action="store_true", help="1 round of 2 s")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 1, 2.0
    if args.rounds < 1 or args.seconds <= 0 or args.processes < 1:
        parser.error("--rounds, --seconds and --processes must be positive")
    started = time.monotonic()
    results: dict[str, list[float]] = {label: [] for label, _ in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="distlock-semaphore-") as folder:
        configure(args.backend, folder)
        for round_number in range(args.rounds):
            turn = round_number % len(VARIANTS)
            for label, permits in VARIANTS[turn:] + VARIANTS[:turn]:
                results[label].append(one_run(label, permits, args.processes, args.seconds))
                print(f"round {round_number + 1} {label}: {results[label][-1]:.0f}/s",
                      file=sys.stderr, flush=True)
    print(f"## Semaphore vs plain lock: acquire + release cycles/s, {args.processes} "
          f"processes, {args.backend}\n\n"
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.rounds} interleaved "
          f"rounds of {args.seconds:g} s; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end\n")
    print("| variant | median cycles/s | rounds |\n|---|---:|---|")
    for label, values in results.items():
        print(f"| {label} | {statistics.median(values):.0f} | "
              + ", ".join(f"{value:.0f}" for value in values) + " |")
    print(f"\n({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
