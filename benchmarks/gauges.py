#!/usr/bin/env python
"""The database-wide gauges' cost (distlock.contrib.prometheus.gauges): the collector's
queries at 1,000 and 1,000,000 lock rows, what each Prometheus scrape adds (issue 34);
and lock_status() of one name on the same tables (issue 29).

    python benchmarks/gauges.py                       # PostgreSQL and SQLite
    python benchmarks/gauges.py --backends sqlite --repeat 50
    python benchmarks/gauges.py --quick               # 1k vs 20k rows

The tables are benchmarks/held.py's: idle free rows, of which 50 are held (an hour's
lease) and 50 expired, spread evenly, with migration 0001's index of the owned rows (the
one the held and expired counts read). Times are the median and the largest of
``--repeat`` scrapes' database reads (:func:`gauges.read`: the clock, the count of the
owned rows, the waiting sessions), warm. Its own databases
``distlock_bench_gauges_<size>``: PostgreSQL's are dropped at the end, SQLite's live in a
temporary folder. Not part of .ci/run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import databases as dbs  # noqa: E402
from benchmarks import held, rows  # noqa: E402

BACKENDS = ("postgresql", "sqlite")


def configure(backends: list[str], sizes: tuple[int, int], folder: str) -> None:
    import django
    from django.conf import settings

    databases: dict[str, Any] = {}
    for size in sizes:
        name = f"distlock_bench_gauges_{rows.label(size).lower()}"
        if "postgresql" in backends:
            databases[rows.alias("postgresql", size)] = {**dbs.pg_settings(), "NAME": name}
        if "sqlite" in backends:
            databases[rows.alias("sqlite", size)] = dbs.sqlite_settings(
                f"{folder}/{name}.sqlite3")
    databases["default"] = dbs.sqlite_settings(f"{folder}/default.sqlite3")
    settings.configure(
        DATABASES=databases, INSTALLED_APPS=["django.contrib.contenttypes", "distlock"],
        USE_TZ=True, SECRET_KEY="bench", DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        DEBUG=False,
    )
    django.setup()


def prepare(db_alias: str, size: int) -> None:
    """held.py's table (which it leaves without the owned-rows index), with the index."""
    from django.db import connections

    from distlock.backends import backend_for

    held.prepare(db_alias, size)
    connection = connections[db_alias]
    with connection.cursor() as cursor:
        cursor.execute(backend_for(connection).owned_index_sql(True))
        cursor.execute("ANALYZE distlock_lock" if connection.vendor == "postgresql"
                       else "ANALYZE")


def time_reads(db_alias: str, repeat: int) -> tuple[float, float, tuple[int, int, int | None]]:
    """(median ms, largest ms, the last reading) of ``repeat`` reads after two warm-ups."""
    from distlock.contrib.prometheus.gauges import read

    times = []
    for i in range(repeat + 2):
        started = time.perf_counter()
        found = read(db_alias)
        if i >= 2:
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), max(times), found


#: lock_status() of a held, an expired, a free and an unknown name (issue 29: "is it
#: locked, by whom, until when, who waits", at a million rows).
STATUS_NAMES = {"held": "fill:0000001", "expired": "fill:0000002", "free": "fill:0000003",
                "no row": "absent"}


def time_status(db_alias: str, repeat: int) -> dict[str, float]:
    """Median ms of ``repeat`` lock_status() calls per kind of name, after two warm-ups."""
    from distlock import lock_status

    medians = {}
    for kind, name in STATUS_NAMES.items():
        times = []
        for i in range(repeat + 2):
            started = time.perf_counter()
            status = lock_status(name, using=db_alias)
            if i >= 2:
                times.append((time.perf_counter() - started) * 1000)
        assert (status.state == "free") == (kind in ("free", "no row")), (kind, status)
        medians[kind] = statistics.median(times)
    return medians


def drop_pg(name: str) -> None:
    import psycopg

    admin = dbs.pg_conninfo().replace(f"dbname={dbs.pg_settings()['NAME']}", "dbname=postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,000 vs 20,000 rows")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--repeat", type=int, default=20, help="timed reads per table")
    parser.add_argument("--keep", action="store_true",
                        help="keep the PostgreSQL databases (a second run skips the fill)")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or set(backends) - set(BACKENDS):
        parser.error(f"--backends: choose from {', '.join(BACKENDS)}")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    sizes = (1000, 20_000 if args.quick else 1_000_000)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="distlock-gauges-") as folder:
        configure(backends, sizes, folder)
        from django.db import connections

        print(f"## distlock database gauges: the collector's reads per scrape\n\n"
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; median and largest of "
              f"{args.repeat} reads, ms\n\n"
              "| backend | rows | median ms | max ms | held | expired | waiting |\n"
              "|---|---:|---:|---:|---:|---:|---:|")
        statuses = {}
        try:
            for backend in backends:
                for size in sizes:
                    db_alias = rows.alias(backend, size)
                    prepare(db_alias, size)
                    median, top, (held_n, expired_n, waiting) = time_reads(db_alias,
                                                                           args.repeat)
                    print(f"| {backend} | {size:,} | {median:.2f} | {top:.2f} | {held_n} | "
                          f"{expired_n} | {'absent' if waiting is None else waiting} |",
                          flush=True)
                    statuses[(backend, size)] = time_status(db_alias, args.repeat)
            print("\n## lock_status() of one name, median ms\n\n| backend | rows | "
                  + " | ".join(STATUS_NAMES) + " |\n|---|---:|" + "---:|" * len(STATUS_NAMES))
            for (backend, size), medians in statuses.items():
                print(f"| {backend} | {size:,} | "
                      + " | ".join(f"{ms:.2f}" for ms in medians.values()) + " |")
        finally:
            connections.close_all()
            if "postgresql" in backends and not args.keep:
                for size in sizes:
                    drop_pg(f"distlock_bench_gauges_{rows.label(size).lower()}")
    print(f"\n({time.monotonic() - started:.0f} s, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
