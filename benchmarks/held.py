#!/usr/bin/env python
""""Which locks are held right now" at 1,000 and 1,000,000 lock rows: with an index made
for it and without, interleaved in the same run (issue 17).

    python benchmarks/held.py                       # all backends, 3 rounds
    python benchmarks/held.py --backends postgresql --rounds 5
    python benchmarks/held.py --quick               # 1k vs 20k rows, one round (CI)

An index that finds held rows must include ``owner`` or ``expires_us``, which every grant
and release changes; on PostgreSQL that ends the heap-only (HOT) updates of those
statements. So each round measures, for each table size and each index design in turn
(rotating the order): the grant path (single-process acquire / renew / release cycles on
100 names, per-operation p50 in µs and cycles/s), the HOT share of the table's updates in
those cycles (PostgreSQL), and the operator views that ask "held now": the Locks
changelist filtered by state (server time through Django's test client, warm) and the
overview's held-now query. Figures are medians over rounds.

The tables: idle free rows (like benchmarks/rows.py's), of which 50 are held (an hour's
lease) and 50 expired and not taken over, spread evenly through the table.
Its own databases ``distlock_bench_held_<size>``; the index designs are created and
dropped by the run (migration 0001's too, which is the design shipped: "(name) WHERE
owner > ''" on PostgreSQL and SQLite, "(owner)" on MariaDB), and the tables are left as
migrated.
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
from benchmarks import rows, rows_admin  # noqa: E402
from benchmarks.harness import percentile  # noqa: E402

BACKENDS = ("postgresql", "mariadb", "sqlite")
INDEX = "distlock_bench_held"
# The designs per vendor: None is the table as shipped.
DESIGNS: dict[str, dict[str, str | None]] = {
    "postgresql": {
        "no index": None,
        "(expires_us) WHERE owner > ''": f"CREATE INDEX {INDEX} ON distlock_lock "
                                          "(expires_us) WHERE owner > ''",
        "(name) WHERE owner > ''": f"CREATE INDEX {INDEX} ON distlock_lock (name) "
                                    "WHERE owner > ''",
    },
    "mysql": {
        "no index": None,
        "(owner, expires_us)": f"CREATE INDEX {INDEX} ON distlock_lock (owner, expires_us)",
        "(owner)": f"CREATE INDEX {INDEX} ON distlock_lock (owner)",
    },
    "sqlite": {
        "no index": None,
        "(expires_us) WHERE owner > ''": f"CREATE INDEX {INDEX} ON distlock_lock "
                                          "(expires_us) WHERE owner > ''",
        "(name) WHERE owner > ''": f"CREATE INDEX {INDEX} ON distlock_lock (name) "
                                    "WHERE owner > ''",
    },
}
VIEWS = ("state = held", "state = expired", "state = free", "Locks changelist")
# Rows held on either size, spread evenly; as many expired.
SPREAD = 50


def configure(backends: list[str], sizes: tuple[int, int], folder: str) -> None:
    import django
    from django.conf import settings

    databases: dict[str, Any] = {}
    for size in sizes:
        name = f"distlock_bench_held_{rows.label(size).lower()}"
        if "postgresql" in backends:
            databases[rows.alias("postgresql", size)] = {**dbs.pg_settings(), "NAME": name}
        if "mariadb" in backends:
            databases[rows.alias("mariadb", size)] = {**dbs.maria_settings(), "NAME": name}
        if "sqlite" in backends:
            databases[rows.alias("sqlite", size)] = dbs.sqlite_settings(
                f"{folder}/{name}.sqlite3")
    databases["default"] = next(iter(databases.values()))
    settings.configure(
        DATABASES=databases,
        INSTALLED_APPS=["django.contrib.contenttypes", *rows_admin.APPS, "distlock"],
        USE_TZ=True, SECRET_KEY="bench", DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        DEBUG=False, **rows_admin.SETTINGS,
    )
    django.setup()


def prepare(db_alias: str, size: int) -> None:
    """rows.py's table, then SPREAD of its rows held and SPREAD expired, evenly apart."""
    from django.db import connections

    from distlock.db import db_now_us

    rows.fill(db_alias, size)
    now = db_now_us(db_alias)
    connection = connections[db_alias]
    with connection.cursor() as cursor:
        set_design(db_alias, None)
        for offset, owner, expires in ((1, "bench-held", now + 3600 * 10**6),
                                       (2, "bench-expired", now - 3600 * 10**6)):
            cursor.execute(
                "UPDATE distlock_lock SET owner = %s, holder = %s, expires_us = %s, "
                "acquired_us = %s WHERE name LIKE 'fill:%%' AND "
                "CAST(SUBSTR(name, 6) AS " + ("SIGNED" if connection.vendor == "mysql"
                                              else "INTEGER") + ") %% %s = %s",
                [owner, owner, expires, now - 60 * 10**6, size // SPREAD, offset])
        if connection.vendor == "postgresql":
            cursor.execute("VACUUM ANALYZE distlock_lock")
        elif connection.vendor == "mysql":
            cursor.execute("ANALYZE TABLE distlock_lock")
            cursor.fetchall()
        else:
            cursor.execute("ANALYZE")


def set_design(db_alias: str, sql: str | None) -> None:
    """Drop the benchmark's index and the shipped one (migration 0001's), then create
    ``sql``'s (None: none)."""
    from django.db import connections

    from distlock.backends import backend_for

    connection = connections[db_alias]
    with connection.cursor() as cursor:
        cursor.execute(backend_for(connection).owned_index_sql(False))
        if connection.vendor == "mysql":
            cursor.execute(f"DROP INDEX IF EXISTS {INDEX} ON distlock_lock")
        else:
            cursor.execute(f"DROP INDEX IF EXISTS {INDEX}")
        if sql:
            cursor.execute(sql)
            if connection.vendor == "postgresql":
                cursor.execute("ANALYZE distlock_lock")


def held_query_ms(db_alias: str, repeat: int) -> float:
    """Median ms of the overview's held-now query (distlock.admin.overview.held_now)."""
    from distlock.admin.overview import held_now
    from distlock.db import db_now_us

    times = []
    for i in range(repeat + 2):
        started = time.perf_counter()
        held_now(db_alias, db_now_us(db_alias))
        if i >= 2:
            times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def server_cpu_ns(db_alias: str) -> int | None:
    """CPU time of this connection's PostgreSQL backend so far (ns, from the kernel's
    scheduler statistics; the server runs on this machine), else None."""
    from django.db import connections

    connection = connections[db_alias]
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    except OSError:
        return None


def grant_path(db_alias: str, cycles: int) -> dict[str, float]:
    """``cycles`` acquire / renew / release cycles on the table as it is now: p50 µs of
    each, cycles/s, client and (PostgreSQL) server CPU per cycle, HOT share."""
    from django.db import connections

    before = rows.hot_counts(db_alias)
    rows.measure(db_alias, 0, 10)  # warm this connection's prepared statements
    server = server_cpu_ns(db_alias)
    client = time.process_time_ns()
    started = time.perf_counter()
    got = rows.measure(db_alias, 0, cycles)
    seconds = time.perf_counter() - started
    result = {op: percentile(got[op], 0.5) for op in ("re-acquire", "renew", "release")}
    result["cycles/s"] = cycles / seconds
    result["client CPU µs/cycle"] = (time.process_time_ns() - client) / cycles / 1000
    server_after = server_cpu_ns(db_alias)
    if server is not None and server_after is not None:
        result["server CPU µs/cycle"] = (server_after - server) / cycles / 1000
    connections[db_alias].close()  # flushes this session's table statistics
    after = rows.hot_counts(db_alias)
    if before and after and after[0] > before[0]:
        result["HOT"] = (after[1] - before[1]) / (after[0] - before[0])
    return result


def one(db_alias: str, cycles: int, repeat: int) -> dict[str, float]:
    """The grant path, its HOT share, and the views, on the table as it is now."""
    result = grant_path(db_alias, cycles)
    result.update(rows_admin.time_pages(db_alias, repeat, only=VIEWS))
    result["held now (overview query)"] = held_query_ms(db_alias, repeat)
    return result


def run_backend(backend: str, sizes: tuple[int, int], args: argparse.Namespace) -> None:
    from django.db import connections

    from distlock.backends import backend_for

    vendor = "mysql" if backend == "mariadb" else backend
    designs = DESIGNS[vendor]
    for size in sizes:
        prepare(rows.alias(backend, size), size)
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    names = list(designs)
    for round_no in range(args.rounds):
        order = names[round_no % len(names):] + names[:round_no % len(names)]
        for size in (sizes if round_no % 2 == 0 else sizes[::-1]):
            for design in order:
                set_design(rows.alias(backend, size), designs[design])
                results.setdefault((size, design), []).append(
                    one(rows.alias(backend, size), args.cycles, args.repeat))
        rows._progress(f"{backend} round {round_no + 1}/{args.rounds}")
    for size in sizes:  # leave the table as migrated
        set_design(rows.alias(backend, size), None)
        with connections[rows.alias(backend, size)].cursor() as cursor:
            cursor.execute(backend_for(connections[rows.alias(backend, size)])
                           .owned_index_sql(True))
    connections.close_all()
    keys = list(results[(sizes[0], names[0])][0])
    print(f"\n{backend}: medians of {args.rounds} round(s); {args.cycles} cycles per "
          "design and round; views in ms, operations p50 µs\n")
    header = " | ".join(f"{rows.label(s)}, {d}" for s in sizes for d in names)
    print(f"| | {header} |\n|---|" + "---:|" * (len(sizes) * len(names)))
    for key in keys:
        cells = []
        for size in sizes:
            for design in names:
                values = [r[key] for r in results[(size, design)] if key in r]
                value = statistics.median(values) if values else None
                cells.append("–" if value is None else
                             f"{value:.1%}" if key == "HOT" else f"{value:,.1f}")
        print(f"| {key} | " + " | ".join(cells) + " |")
    # The grant path's price of each index: per-round ratios, same table size.
    print()
    for size in sizes:
        for design in names[1:]:
            for key in ("cycles/s", "server CPU µs/cycle"):
                pairs = [(w[key], wo[key]) for w, wo in zip(
                    results[(size, design)], results[(size, names[0])], strict=True)
                    if key in w and key in wo]
                if pairs:
                    ratio = statistics.median(w / wo for w, wo in pairs)
                    print(f"{rows.label(size)}: {key} with {design} / without: {ratio:.2f}")


def grant_pairs(backend: str, size: int, args: argparse.Namespace) -> None:
    """--pairs: the grant path alone on the large table, without the index and with the
    shipped one (migration 0001's) in turn, ``--pairs`` times, so that the machine's
    changing load falls on both alike; the median of the per-pair ratios."""
    from django.db import connections

    from distlock.backends import backend_for

    db_alias = rows.alias(backend, size)
    shipped = backend_for(connections[db_alias]).owned_index_sql(True)
    got: dict[str, list[dict[str, float]]] = {"no index": [], "shipped": []}
    for pair in range(args.pairs):
        for design in (("no index", "shipped") if pair % 2 == 0 else ("shipped", "no index")):
            set_design(db_alias, shipped if design == "shipped" else None)
            row = grant_path(db_alias, args.cycles)
            got[design].append(row)
    set_design(db_alias, shipped)
    print(f"\n{backend}, {rows.label(size)} rows: grant path without / with the shipped index, "
          f"{args.pairs} alternations of {args.cycles} cycles (medians)\n\n"
          "| | no index | shipped index | with / without (median of pairs) |\n"
          "|---|---:|---:|---:|")
    for key in ("cycles/s", "client CPU µs/cycle", "server CPU µs/cycle", "HOT"):
        if key not in got["no index"][0]:
            continue
        without = [r[key] for r in got["no index"]]
        with_index = [r[key] for r in got["shipped"]]
        ratio = statistics.median(w / wo for w, wo in zip(with_index, without, strict=True)
                                  if wo)
        fmt = "{:.1%}" if key == "HOT" else "{:,.1f}"
        print(f"| {key} | {fmt.format(statistics.median(without))} | "
              f"{fmt.format(statistics.median(with_index))} | "
              f"{'–' if key == 'HOT' else f'{ratio:.2f}'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1,000 vs 20,000 rows, one short round: proves it runs")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=1000, help="grant cycles per design")
    parser.add_argument("--repeat", type=int, default=5, help="timed fetches per view")
    parser.add_argument("--big", type=int, default=1_000_000, help="rows of the large table")
    parser.add_argument("--pairs", type=int, default=0,
                        help="then the grant path alone, without and with the shipped "
                             "index, this many times each on the large table")
    parser.add_argument("--no-views", action="store_true",
                        help="skip the rounds of designs and views (with --pairs)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.cycles, args.repeat, args.big = 1, 50, 1, 20_000
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or set(backends) - set(BACKENDS):
        parser.error(f"--backends: choose from {', '.join(BACKENDS)}")
    if args.rounds < 1 or args.cycles < 1 or args.repeat < 1 or args.big < 2000:
        parser.error("need --rounds, --cycles, --repeat ≥ 1 and --big ≥ 2000")
    sizes = (1000, args.big)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="distlock-held-") as folder:
        configure(backends, sizes, folder)
        print(f"## distlock held-now benchmark\n\n"
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for backend in backends:
            if not args.no_views:
                run_backend(backend, sizes, args)
            if args.pairs:
                if args.no_views:
                    prepare(rows.alias(backend, sizes[1]), sizes[1])
                grant_pairs(backend, sizes[1], args)
    print(f"\n({time.monotonic() - started:.0f} s, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
