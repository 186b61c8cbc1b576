#!/usr/bin/env python
"""Client CPU of one acquire → release cycle in one process, and where it goes (cProfile).

    python benchmarks/profile_cycle.py                      # both transports, 20,000 cycles
    python benchmarks/profile_cycle.py --transport socket --profile 25
    python benchmarks/profile_cycle.py --transport socket --debug   # and under DEBUG = True
    python benchmarks/profile_cycle.py --backend mariadb --profile 25  # or sqlite

One process loops ``acquire(name, blocking=False)`` + ``Lease.release()`` on a name of its
own, and A's two statements by the raw driver (psycopg; with ``--backend``: mysqlclient
or sqlite3) beside it, alternating in blocks, and prints the client CPU per cycle of each
(``time.process_time()``) and their ratio — the "client CPU ≤ 1.3× A" figure of issue 15
without 8 processes sharing the cores. ``--debug`` adds distlock's loop with ``DEBUG =
True`` (Django's query log on, as in a project made by ``startproject``), alternating
with the others. ``--profile N`` then runs distlock's loop under cProfile and prints its
N most expensive functions (own
time), which is how the layers of the path were weighed (docs/performance.md).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
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


class DistlockDebug(c.Distlock):
    """distlock with Django's query log on (``DEBUG = True``) for its blocks only."""

    def __init__(self, alias: str) -> None:
        super().__init__(alias, "distlock, DEBUG = True")


def cycles(contender: c.Contender, name: str, count: int) -> float:
    """Client CPU µs per cycle over ``count`` cycles."""
    from django.conf import settings
    from django.db import connections

    debug = isinstance(contender, DistlockDebug)
    settings.DEBUG = debug
    began = time.process_time()
    for _ in range(count):
        handle = contender.try_acquire(name)
        assert handle is not None, f"{name} was busy: another run uses it?"
        contender.release(handle)
    spent = (time.process_time() - began) / count * 1e6
    settings.DEBUG = False
    if debug:
        connections[contender.alias].queries_log.clear()  # type: ignore[attr-defined]
    return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["postgresql", "mariadb", "sqlite"],
                        default="postgresql")
    parser.add_argument("--transport", choices=[*dbs.TRANSPORTS, "both"], default="both",
                        help="PostgreSQL only")
    parser.add_argument("--cycles", type=int, default=20_000)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--debug", action="store_true",
                        help="also distlock's loop under DEBUG = True (Django's query log)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="then profile distlock's loop and print its N top functions")
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.blocks < 1:
        parser.error("need --cycles ≥ 1 and --blocks ≥ 1")
    sqlite_path = str(Path(tempfile.mkdtemp()) / "profile.sqlite3")
    # A name of this run's own: a run killed between acquire and release leaves its name
    # held until the ttl ends.
    name = f"profile:{os.getpid()}"
    if args.backend == "postgresql":
        transports = list(dbs.TRANSPORTS) if args.transport == "both" else [args.transport]
        run.configure(["postgresql"], False, sqlite_path, transports=transports)
        dbs.create_pg()
        dbs.prepare(run.pg_alias(transports[0]), dbs.POOL)
        runs = [(transport, run.pg_alias(transport),
                 c.PgUpsert(dbs.pg_conninfo(transport=transport)))
                for transport in transports]
    elif args.backend == "mariadb":
        run.configure(["mariadb"], False, sqlite_path)
        dbs.create_maria()
        dbs.prepare("mariadb", dbs.POOL)
        runs = [("mariadb", "mariadb", c.MariaUpsert(dbs.maria_params()))]
    else:
        run.configure(["sqlite"], False, sqlite_path)
        dbs.prepare("sqlite", dbs.POOL)
        runs = [("sqlite", "sqlite", c.SqliteUpsert(sqlite_path))]
    for where, alias, reference in runs:
        contenders: list[Any] = [reference, c.Distlock(alias)]
        if args.debug:
            contenders.append(DistlockDebug(alias))
        for contender in contenders:
            contender.connect()
            cycles(contender, name, 500)  # warm-up: statements prepared, caches filled
        per = args.cycles // args.blocks
        seen: dict[str, list[float]] = {x.label: [] for x in contenders}
        for block in range(args.blocks):
            for contender in run.rotated(contenders, block):
                seen[contender.label].append(cycles(contender, name, per))
        a, mine, *debug = (statistics.median(seen[x.label]) for x in contenders)
        print(f"{where}: client CPU µs/cycle, median of {args.blocks} blocks of {per}: "
              f"A {a:.0f}, distlock {mine:.0f} ({mine / a:.2f}× A)"
              + "".join(f", under DEBUG {d:.0f} ({d / a:.2f}× A)" for d in debug))
        if args.profile:
            profiler = cProfile.Profile(time.process_time)
            profiler.runcall(cycles, contenders[1], name, per)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        for contender in contenders:
            contender.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
