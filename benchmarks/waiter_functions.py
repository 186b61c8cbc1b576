#!/usr/bin/env python
"""Where the server's time per grant goes on one contended PostgreSQL name, by SQL function.

    python benchmarks/waiter_functions.py                 # 8 and 64 waiters, 2 rounds
    python benchmarks/waiter_functions.py --many 16 --rounds 1 --seconds 3

The workers of ``benchmarks/waiters.py`` (its ``measure()``: blocking acquires on the name
"waited"), on a database of their own (``distlock_bench`` + ``--db-suffix``, default
``_funcs``) with ``track_functions = 'pl'``. Before each scenario the database's
statistics are reset; after it, once every worker's session has ended (a backend
reports its function statistics when it exits), ``pg_stat_user_functions`` is read and
divided by the ``distlock_release`` calls: one per grant, warm-up included. The figures
are each function's elapsed time on the server — its own CPU and its waits for row and
advisory locks — not CPU alone; ``waiters.py``'s server CPU per grant of the same
scenario is printed beside them. docs/performance.md, "64 waiters: where the server's
time per grant goes", has a run. Drop the database when done
(``DROP DATABASE distlock_bench_funcs``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import databases as dbs  # noqa: E402
from benchmarks import waiters  # noqa: E402


def wait_for_workers_to_end(admin: object, database: str, timeout: float = 30.0) -> None:
    """Until no other session is connected to ``database`` (their statistics are in)."""
    deadline = time.monotonic() + timeout
    while admin.execute(  # type: ignore[attr-defined]
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
        [database],
    ).fetchone()[0]:
        if time.monotonic() > deadline:
            raise SystemExit(f"sessions still connected to {database} after {timeout} s")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--many", type=int, default=64)
    parser.add_argument("--db-suffix", default="_funcs")
    args = parser.parse_args(argv)

    import psycopg

    waiters.SUFFIX = args.db_suffix
    database = f"distlock_bench{args.db_suffix}"
    dbs.setup_django({"default": dbs.pg_settings(args.db_suffix)})
    dbs.create_pg(args.db_suffix)
    dbs.prepare("default", 1)
    from django.db import connections

    connections.close_all()  # the stats wait below counts every other session
    with psycopg.connect(dbs.pg_conninfo(args.db_suffix), autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{database}" SET track_functions = \'pl\'')
        for round_no in range(args.rounds):
            for procs in (8, args.many):
                admin.execute("SELECT pg_stat_reset()")
                result = waiters.measure("distlock", procs, 0.0, args.seconds, args.warmup)
                wait_for_workers_to_end(admin, database)
                rows = admin.execute(
                    "SELECT funcname, calls, total_time, self_time FROM pg_stat_user_functions "
                    "ORDER BY self_time DESC"
                ).fetchall()
                grants = next((calls for name, calls, *_ in rows if name == "distlock_release"), 0)
                print(f"\n{procs} waiters, round {round_no + 1}: {result['rate']:,.0f} grants/s, "
                      f"server CPU {result['server_us']:,.0f} µs/grant; {grants} grants "
                      "(warm-up included)")
                print("| function | calls/grant | own µs/grant | with callees µs/grant |")
                print("|---|---:|---:|---:|")
                for name, calls, total_ms, self_ms in rows:
                    if calls and grants:
                        print(f"| {name} | {calls / grants:.2f} | {self_ms * 1e3 / grants:,.1f} "
                              f"| {total_ms * 1e3 / grants:,.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
