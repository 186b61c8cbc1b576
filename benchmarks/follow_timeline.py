#!/usr/bin/env python
"""What the timeline follow costs (issue 32): a new connection, and an acquire + release,
with ``DISTLOCK_FOLLOW_TIMELINE`` on and off, interleaved in the same run.

    python benchmarks/follow_timeline.py                  # 5 rounds
    python benchmarks/follow_timeline.py --rounds 9 --transport socket
    python benchmarks/follow_timeline.py --quick          # 1 short round (CI: it runs)

The follow is a ``connection_created`` receiver: one statement per new PostgreSQL
session (the server's timeline and the recorded one), nothing per lock operation. So
each round measures, with the follow on and then off (the order alternating between
rounds): ``connect`` — close Django's connection and open a new one (``ensure_connection``,
the receivers included), per connection in µs (median of the round); and ``cycle`` — an
acquire and a release of one name on an open connection, per cycle in µs. The figures
are medians over the rounds, and the ratio on/off of each. Database
``distlock_bench_follow`` on the benchmark server (DISTLOCK_BENCH_POSTGRES), created and
migrated here; drop it when done.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import databases as dbs  # noqa: E402

NAME = "distlock_bench_follow"


def per_connect(count: int) -> float:
    """Median µs to close Django's connection and open a new one."""
    from django.db import connection

    times = []
    for _ in range(count):
        connection.close()
        started = time.perf_counter()
        connection.ensure_connection()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def per_cycle(count: int) -> float:
    """Median µs of an acquire and a release of one name."""
    from distlock import acquire

    times = []
    for _ in range(count):
        started = time.perf_counter()
        lease = acquire("bench:follow", ttl=30)
        assert lease is not None
        lease.release()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--connects", type=int, default=200)
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--transport", choices=dbs.TRANSPORTS, default="tcp")
    parser.add_argument("--quick", action="store_true", help="one short round")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.connects, args.cycles = 1, 20, 100
    dbs.create_pg(name=NAME)
    dbs.setup_django({"default": {**dbs.pg_settings(transport=args.transport), "NAME": NAME}})
    from django.core.management import call_command
    from django.test import override_settings

    call_command("migrate", "distlock", verbosity=0)
    figures: dict[tuple[str, bool], list[float]] = {}
    for round_no in range(args.rounds):
        for follow in ((True, False) if round_no % 2 == 0 else (False, True)):
            with override_settings(DISTLOCK_FOLLOW_TIMELINE=follow):
                figures.setdefault(("connect", follow), []).append(per_connect(args.connects))
                per_cycle(args.cycles // 10)  # warm: the prepared statements, the row
                figures.setdefault(("cycle", follow), []).append(per_cycle(args.cycles))
        print(f"round {round_no + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"timeline follow, PostgreSQL over {args.transport}, {args.rounds} round(s), "
          f"median µs (on / off = ratio):")
    for what in ("connect", "cycle"):
        on = statistics.median(figures[what, True])
        off = statistics.median(figures[what, False])
        print(f"  {what:8} on {on:9.1f}  off {off:9.1f}  on/off {on / off:5.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
