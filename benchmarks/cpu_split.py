#!/usr/bin/env python
"""Where a cycle's CPU goes: client process against its PostgreSQL backend, per layer.

    python benchmarks/cpu_split.py              # 8 processes on their own names, 3 rounds
    python benchmarks/cpu_split.py --procs 1    # the same from one process
    python benchmarks/cpu_split.py --transport socket   # one transport (default: both)

The "8 processes on their own names" figure is CPU-bound on a small machine (clients and
backends share the cores), so its rate is the cores divided by client + backend CPU per
cycle. This script measures both halves — the client from ``time.process_time()``, the
backend from ``/proc/<backend pid>/stat`` (so it runs on the database's own machine) —
for four contenders that peel distlock's layers off one at a time:

- A, the reference (one upsert, one update, raw psycopg);
- distlock's SQL functions called by raw psycopg on a connection of its own;
- the same calls on the Django connection that distlock uses (Django's connection setup);
- distlock's public API, ``acquire(blocking=False)`` + ``Lease.release()``.

The differences between rows tell which layer a cycle's extra CPU comes from. Prints one
table of medians over rounds per transport (PostgreSQL's Unix socket, TCP); like run.py,
read the ratios, not the absolute numbers.
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

from benchmarks import contenders as c  # noqa: E402
from benchmarks import databases as dbs  # noqa: E402
from benchmarks import run  # noqa: E402
from distlock.backends import postgresql  # noqa: E402
from distlock.backends.results import Grant  # noqa: E402

HOLDER = "bench pid=0 thread=MainThread"  # as long as distlock's own holder text
PG = postgresql.PostgreSQL()


class SqlFunctions(c._Psycopg):
    """distlock's own statements (distlock_acquire, distlock_release) on a raw psycopg
    connection, every statement prepared, the release not durable (the defaults)."""

    label = "distlock's SQL functions, raw psycopg"

    def connect(self) -> None:
        super().connect()
        self.conn.prepare_threshold = 0

    def try_acquire(self, name: str) -> Any:
        owner = os.urandom(16).hex()
        result = PG.acquire_existing(self.cur, name, owner, HOLDER, c.TTL_S * 1_000_000)
        return (name, owner, result.token) if isinstance(result, Grant) else None

    def release(self, handle: Any) -> None:
        postgresql.release(self.cur, *handle, False)


class SqlFunctionsOnDjango(SqlFunctions):
    """The same statements on the psycopg connection of Django's ``default`` alias."""

    label = "the same on Django's connection"

    def __init__(self, alias: str) -> None:
        super().__init__("")
        self.alias = alias

    def connect(self) -> None:
        import psycopg
        from django.db import connections

        connection = connections[self.alias]
        connection.ensure_connection()
        self.conn = connection.connection
        self.conn.prepare_threshold = 0
        self.cur = psycopg.Cursor(self.conn)


def backend_pid(contender: c.Contender) -> int:
    if isinstance(contender, c.Distlock):
        from django.db import connections

        return int(connections[contender.alias].connection.info.backend_pid)
    return int(contender.conn.info.backend_pid)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` so far (fields 14 and 15 of its stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker(contender: c.Contender, index: int, seconds: float, barrier: Any,
           results: Any) -> None:
    contender.connect()
    pid = backend_pid(contender)
    name = f"own:{index}"
    for _ in range(200):  # warm-up: statements prepared, caches filled
        contender.release(contender.try_acquire(name))
    barrier.wait()
    client, backend, cycles = time.process_time(), cpu_seconds(pid), 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        handle = contender.try_acquire(name)
        assert handle is not None, f"{name} was busy: another run uses it?"
        contender.release(handle)
        cycles += 1
    results.put((cycles, time.process_time() - client, cpu_seconds(pid) - backend))
    contender.close()


def measure(contender: c.Contender, procs: int, seconds: float) -> tuple[float, float, float]:
    """(cycles/s, client CPU µs per cycle, backend CPU µs per cycle), all workers."""
    from django.db import connections

    # Forked children must not share the parent's sockets: a child closing an inherited
    # connection would end the parent's session with it.
    connections.close_all()
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(procs), context.Queue()
    workers = [context.Process(target=worker, args=(contender, i, seconds, barrier, results))
               for i in range(procs)]
    for process in workers:
        process.start()
    reports = [results.get(timeout=seconds + 120) for _ in workers]
    for process in workers:
        process.join()
        if process.exitcode:
            raise SystemExit(f"a worker of {contender.label} failed")
    cycles = sum(r[0] for r in reports)
    return (cycles / seconds, sum(r[1] for r in reports) / cycles * 1e6,
            sum(r[2] for r in reports) / cycles * 1e6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--transport", choices=[*dbs.TRANSPORTS, "both"], default="both",
                        help="PostgreSQL over its Unix socket, TCP or both (default)")
    args = parser.parse_args(argv)
    if args.procs < 1 or args.rounds < 1 or args.seconds <= 0:
        parser.error("need --procs ≥ 1, --rounds ≥ 1 and --seconds > 0")
    transports = run.pick_transports(args.transport, False)
    run.configure(["postgresql"], False, str(Path(tempfile.mkdtemp()) / "unused.sqlite3"),
                  list(transports))
    dbs.create_pg()
    dbs.prepare("default", dbs.POOL)
    print(f"{args.procs} process(es) on their own names, {args.rounds} rounds of "
          f"{args.seconds} s, medians; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the start\n")
    for transport in transports:
        alias, conninfo = run.pg_alias(transport), dbs.pg_conninfo(transport=transport)
        contenders = [c.PgUpsert(conninfo), SqlFunctions(conninfo),
                      SqlFunctionsOnDjango(alias), c.Distlock(alias)]
        seen: dict[str, list[tuple[float, float, float]]] = {x.label: [] for x in contenders}
        for round_no in range(args.rounds):
            for contender in run.rotated(contenders, round_no):
                dbs.maintain(alias)
                seen[contender.label].append(measure(contender, args.procs, args.seconds))
        print(f"| {transport} | cycles/s | × A | client CPU µs/cycle | × A "
              "| backend CPU µs/cycle | × A | sum |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        reference = seen[contenders[0].label]
        a_client = statistics.median(r[1] for r in reference)
        a_backend = statistics.median(r[2] for r in reference)
        for label, runs in seen.items():
            rate = statistics.median(r[0] for r in runs)
            vs_a = statistics.median(mine[0] / ref[0] for mine, ref in zip(runs, reference,
                                                                          strict=True))
            client = statistics.median(r[1] for r in runs)
            backend = statistics.median(r[2] for r in runs)
            print(f"| {label} | {rate:,.0f} | {vs_a:.2f} | {client:.0f} "
                  f"| {client / a_client:.2f} | {backend:.0f} | {backend / a_backend:.2f} "
                  f"| {client + backend:.0f} |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
