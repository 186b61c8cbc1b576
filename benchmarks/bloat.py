#!/usr/bin/env python
"""Index bloat of the lock table under grants, on PostgreSQL with autovacuum on.

Since the held-now index (migration 0001; 0.2's 0005) a grant and a release change ``owner``, the
index's condition, so neither is a heap-only (HOT) update: each writes new entries in
every index of the lock table and leaves a dead row version for vacuum. This soak runs
grant/release cycles on random names of a large table for ``--minutes`` and samples, every
``--every`` seconds, the size of the table and of each of its indexes, ``n_dead_tup``
and the autovacuum count (``pg_stat_user_tables``), to show whether autovacuum keeps up.

    python benchmarks/bloat.py --db-suffix _rows --minutes 5

Uses rows.py's large table (``distlock_bench_rw_1m<suffix>``, filled by rows.py if it is
missing or short).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import rows  # noqa: E402

SIZE = 1_000_000
SAMPLE = (
    "SELECT pg_relation_size('distlock_lock'), n_live_tup, n_dead_tup, autovacuum_count, "
    "n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'distlock_lock'"
)
INDEXES = (
    "SELECT indexrelname, pg_relation_size(indexrelid) FROM pg_stat_user_indexes "
    "WHERE relname = 'distlock_lock' ORDER BY indexrelname"
)


def sample(cursor: object) -> tuple[tuple[int, ...], dict[str, int]]:
    cursor.execute("SELECT pg_stat_clear_snapshot()")  # type: ignore[attr-defined]
    cursor.execute(SAMPLE)  # type: ignore[attr-defined]
    table = tuple(int(x) for x in cursor.fetchone())  # type: ignore[attr-defined]
    cursor.execute(INDEXES)  # type: ignore[attr-defined]
    return table, {name: int(size) for name, size in cursor.fetchall()}  # type: ignore[attr-defined]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--db-suffix", default="")
    args = parser.parse_args()
    if args.minutes <= 0 or args.every <= 0:
        parser.error("--minutes and --every must be positive")
    with tempfile.TemporaryDirectory(prefix="distlock-bloat-") as folder:
        rows.configure(["postgresql"], (1000, SIZE), folder, args.db_suffix)
        from django.db import connections

        from distlock import acquire

        alias = rows.alias("postgresql", SIZE)
        rows.fill(alias, SIZE)
        cursor = connections[alias].cursor()
        names = [f"fill:{i:07d}" for i in range(SIZE)]
        mb = 1 << 20
        print(f"PostgreSQL, {SIZE:,} rows, grant + release cycles on random names, "
              f"{args.minutes:g} min; sizes in MB\n")
        first, first_indexes = sample(cursor)
        heads = " | ".join(first_indexes)
        print(f"| s | cycles | table | {heads} | live | dead | autovacuums | HOT % |")
        print("|" + "---:|" * (7 + len(first_indexes)))
        started = time.monotonic()
        cycles = 0
        next_sample = 0.0
        while True:
            now = time.monotonic() - started
            if now >= next_sample:
                table, indexes = sample(cursor)
                upd, hot = table[4] - first[4], table[5] - first[5]
                sizes = " | ".join(f"{indexes[name] / mb:.1f}" for name in first_indexes)
                print(f"| {now:.0f} | {cycles:,} | {table[0] / mb:.1f} | {sizes} | "
                      f"{table[1]:,} | {table[2]:,} | {table[3]} | "
                      f"{100 * hot / upd if upd else 0:.1f} |", flush=True)
                next_sample += args.every
                if now >= args.minutes * 60:
                    break
            lease = acquire(random.choice(names), ttl=30, using=alias, blocking=False)
            if lease is not None:
                lease.release()
            cycles += 1
        connections.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
