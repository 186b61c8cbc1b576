#!/usr/bin/env python
"""Lock operations on a small against a large lock table: no operation may cost more as
the table grows (issue 17).

    python benchmarks/rows.py                  # 1,000 vs 1,000,000 rows, all backends
    python benchmarks/rows.py --quick          # 1,000 vs 20,000 rows, short (CI)
    python benchmarks/rows.py --backends postgresql --rounds 7

Method: one process, one connection per table. Each table is filled once with idle rows
(free, expired long ago) by one server-side statement and kept between runs. A round
times, on each table in turn (the order alternates between rounds): the first use of new
names (``acquire`` of a name with no row), then cycles on 100 existing names — acquire,
renew, release, each timed on its own. Every figure is the median over rounds of each
round's p50 (or p99); "big / small" is the median of the per-round ratios of p50s.

On PostgreSQL it also reports the share of the lock table's updates during the run that
were heap-only (HOT): ``n_tup_hot_upd / n_tup_upd`` of ``pg_stat_user_tables``, counted
before and after. Then the Locks list's search box with terms of each kind. Last,
"purge beside acquire" (benchmarks/rows_purge.py: idle, beside a purge, beside a process
that only burns the purge's CPU; ``--purge-batch`` / ``--purge-rest`` compare settings,
``--purge-events N`` adds audit retention over N events, ``--only-purge`` runs nothing
else). A purge empties the large table, which is filled again before each round.

Its own databases, never the test ones: PostgreSQL and MariaDB ``distlock_bench_rw_<size>``
on the servers of DISTLOCK_BENCH_POSTGRES / DISTLOCK_BENCH_MARIADB (``--db-suffix``
appended), SQLite files in a temporary folder; Django's own tables (the admin's user) in
a SQLite file of their own, so any subset of ``--backends`` runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import databases as dbs  # noqa: E402
from benchmarks import rows_admin, rows_purge  # noqa: E402
from benchmarks.harness import percentile  # noqa: E402

BACKENDS = ("postgresql", "mariadb", "sqlite")
OPERATIONS = ("first use", "re-acquire", "renew", "release")
HOT_NAMES = 100
TTL = 30.0


def label(size: int) -> str:
    return f"{size // 1_000_000}M" if size % 1_000_000 == 0 else f"{size // 1000}k"


def alias(backend: str, size: int) -> str:
    return f"{backend}_{label(size)}"


def configure(backends: list[str], sizes: tuple[int, int], folder: str,
              suffix: str = "") -> None:
    import django
    from django.conf import settings

    databases: dict[str, Any] = {}
    for size in sizes:
        name = f"distlock_bench_rw_{label(size).lower()}{suffix}"
        if "postgresql" in backends:
            pg = dbs.pg_settings()
            databases[alias("postgresql", size)] = {**pg, "NAME": name}
        if "mariadb" in backends:
            databases[alias("mariadb", size)] = {**dbs.maria_settings(), "NAME": name}
        if "sqlite" in backends:
            databases[alias("sqlite", size)] = dbs.sqlite_settings(f"{folder}/{name}.sqlite3")
    # Django's own tables (the admin's user and session) in a file of their own: a
    # benchmark database is created by fill(), after Django has set up.
    databases["default"] = dbs.sqlite_settings(f"{folder}/default.sqlite3")
    settings.configure(
        DATABASES=databases,
        INSTALLED_APPS=["django.contrib.contenttypes", *rows_admin.APPS, "distlock"],
        USE_TZ=True, SECRET_KEY="bench", DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        DEBUG=False, **rows_admin.SETTINGS,
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", database="default", verbosity=0, interactive=False)


def create_database(db_alias: str) -> None:
    """Create the server database of ``db_alias`` if it is missing (not SQLite's)."""
    from django.db import connections

    s = connections[db_alias].settings_dict
    if s["ENGINE"].endswith("postgresql"):
        dbs.create_pg(name=s["NAME"])
    elif s["ENGINE"].endswith("mysql"):
        dbs.create_maria(name=s["NAME"])


FILL = {
    # One statement each: a million rows in seconds, not a million round trips.
    "postgresql": "INSERT INTO distlock_lock (name, token, owner, holder, expires_us, "
                  "renew_count) SELECT 'fill:' || lpad(i::text, 7, '0'), 1, '', '', 0, 0 "
                  "FROM generate_series(0, {last}) AS i",
    # MariaDB's Sequence engine (seq_0_to_N tables), present in every MariaDB build.
    "mysql": "INSERT INTO distlock_lock (name, token, owner, holder, expires_us, renew_count) "
             "SELECT CONCAT('fill:', LPAD(seq, 7, '0')), 1, '', '', 0, 0 FROM seq_0_to_{last}",
    "sqlite": "WITH RECURSIVE seq(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM seq "
              "WHERE i < {last}) INSERT INTO distlock_lock (name, token, owner, holder, "
              "expires_us, renew_count) SELECT 'fill:' || printf('%07d', i), 1, '', '', 0, 0 "
              "FROM seq",
}


def fill(db_alias: str, size: int) -> None:
    """Migrate, and make the table hold ``size`` idle rows plus the HOT_NAMES cycled ones."""
    from django.core.management import call_command
    from django.db import connections

    from distlock import acquire

    create_database(db_alias)
    call_command("migrate", database=db_alias, verbosity=0, interactive=False)
    connection = connections[db_alias]
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM distlock_lock WHERE name LIKE 'new:%%'")
        cursor.execute("SELECT COUNT(*) FROM distlock_lock WHERE name LIKE 'fill:%%'")
        have = cursor.fetchone()[0]
        if have != size:
            _progress(f"{db_alias}: filling {size:,} rows")
            cursor.execute("DELETE FROM distlock_lock WHERE name LIKE 'fill:%%'")
            cursor.execute(FILL[connection.vendor].format(last=size - 1))
            if connection.vendor == "mysql":
                cursor.execute("ANALYZE TABLE distlock_lock")
                cursor.fetchall()
            elif connection.vendor == "sqlite":
                cursor.execute("ANALYZE")
        # Start each run from written-out tables, not behind a fill's WAL.
        if connection.vendor == "postgresql":
            cursor.execute("VACUUM ANALYZE distlock_lock")
            cursor.execute("CHECKPOINT")
        elif connection.vendor == "sqlite":
            cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for i in range(HOT_NAMES):
        lease = acquire(f"hot:{i:03d}", ttl=TTL, using=db_alias, blocking=False)
        if lease is not None:
            lease.release()


def token_index(db_alias: str, wanted: bool) -> None:
    """--token-index: the road not taken, an index on ``token`` (it would make MAX cheap,
    and every grant's update of ``token`` a non-HOT one that writes the index too)."""
    from django.db import connections

    with connections[db_alias].cursor() as cursor:
        if wanted:
            cursor.execute("CREATE INDEX IF NOT EXISTS distlock_bench_token "
                           "ON distlock_lock (token)")
        elif connections[db_alias].vendor == "mysql":
            cursor.execute("DROP INDEX IF EXISTS distlock_bench_token ON distlock_lock")
        else:
            cursor.execute("DROP INDEX IF EXISTS distlock_bench_token")


def timed(call: Any) -> tuple[Any, float]:
    started = time.perf_counter_ns()
    result = call()
    return result, (time.perf_counter_ns() - started) / 1000


def measure(db_alias: str, firsts: int, cycles: int) -> dict[str, list[float]]:
    """Latencies in µs of each operation, ``firsts`` first uses and ``cycles`` cycles."""
    from distlock import acquire

    got: dict[str, list[float]] = {op: [] for op in OPERATIONS}
    run = uuid.uuid4().hex[:8]
    for i in range(firsts):
        lease, took = timed(lambda i=i: acquire(f"new:{run}:{i:05d}", ttl=TTL,
                                                using=db_alias, blocking=False))
        got["first use"].append(took)
        lease.release()
    for i in range(cycles):
        name = f"hot:{i % HOT_NAMES:03d}"
        lease, took = timed(lambda name=name: acquire(name, ttl=TTL, using=db_alias,
                                                      blocking=False))
        got["re-acquire"].append(took)
        got["renew"].append(timed(lambda lease=lease: lease.renew(ttl=TTL))[1])
        got["release"].append(timed(lease.release)[1])
    return got


def hot_counts(db_alias: str) -> tuple[int, int] | None:
    """(n_tup_upd, n_tup_hot_upd) of the lock table on PostgreSQL, as flushed so far."""
    from django.db import connections

    connection = connections[db_alias]
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        # This session's own counts reach the shared statistics at its next transaction end.
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                       "WHERE relname = 'distlock_lock'")
        upd, hot = cursor.fetchone()
    return int(upd), int(hot)


def admin_pages(backend: str, sizes: tuple[int, int], args: argparse.Namespace) -> None:
    """The admin pages on both tables, as configured, and on the large one also with
    Django's defaults (a second count of the whole table under a filter or search, and
    facet counts on request)."""
    from django.contrib import admin

    from distlock.models import Lock

    model_admin = admin.site._registry[Lock]
    # The small table keeps a small history (1,000 events); the large one gets --events.
    for size, events in zip(sizes, (min(1000, args.events), args.events), strict=True):
        rows_admin.fill_events(alias(backend, size), events, size)
    skipped = {label.strip() for label in args.skip_pages.split(";")}
    wanted = [page for page in rows_admin.pages() if page not in skipped]
    small, big = (rows_admin.time_pages(alias(backend, size), args.admin_repeat, wanted)
                  for size in sizes)
    tuned = (model_admin.show_full_result_count, model_admin.show_facets)
    model_admin.show_full_result_count, model_admin.show_facets = True, admin.ShowFacets.ALLOW
    try:
        defaults = ({page: float("nan") for page in big} if args.no_admin_defaults else
                    rows_admin.time_pages(alias(backend, sizes[1]), args.admin_repeat, wanted))
    finally:
        model_admin.show_full_result_count, model_admin.show_facets = tuned
    s, b = label(sizes[0]), label(sizes[1])
    print(f"\n| admin ({backend}, median ms; events {min(1000, args.events):,} / "
          f"{args.events:,}) | {s} | {b} | {b}, Django's defaults |\n"
          "|---|---:|---:|---:|")
    for page in small:
        print(f"| {page} | {small[page]:,.1f} | {big[page]:,.1f} | {defaults[page]:,.1f} |")
    small, big = (rows_admin.time_commands(alias(backend, size), args.admin_repeat)
                  for size in sizes)
    for command in small:
        print(f"| `{command}` (command, output to memory) | {small[command]:,.1f} | "
              f"{big[command]:,.1f} | – |")
    small, big = (search_times(alias(backend, size), args.admin_repeat) for size in sizes)
    print(f"\n| Locks search ({backend}, median ms) | {s} | {b} |\n|---|---:|---:|")
    for what, term in SEARCHES.items():
        print(f"| {what} (`{term}`) | {small[what]:,.1f} | {big[what]:,.1f} |")


# The Locks list's search box (distlock/admin/search.py) with terms of each kind: a
# prefix of 1 name, of about 1% of the large table, of all of it, one exact name, none.
SEARCHES = {"prefix, 1 name": "hot:042", "prefix, 1% of rows": "fill:00",
            "prefix, every fill row": "fill:", "exact (=name)": "=hot:042",
            "prefix, no name": "zzz"}


def search_times(db_alias: str, repeat: int) -> dict[str, float]:
    """Median server milliseconds of the Locks list searched for each of SEARCHES."""
    from django.contrib.auth.models import User
    from django.test import Client, override_settings
    from django.urls import reverse

    user = User.objects.filter(username="bench").first() or User.objects.create_superuser(
        "bench", "bench@example.com", "bench")
    client = Client()
    client.force_login(user)
    url = reverse("admin:distlock_lock_changelist")
    got = {}
    with override_settings(DISTLOCK_DATABASE=db_alias):
        for what, term in SEARCHES.items():
            times = []
            for i in range(repeat + 2):  # two warm-ups
                started = time.perf_counter()
                response = client.get(url, {"q": term})
                assert response.status_code == 200, (term, response.status_code)
                if i >= 2:
                    times.append((time.perf_counter() - started) * 1000)
            got[what] = statistics.median(times)
    return got


def _progress(text: str) -> None:
    print(f"  … {text}", file=sys.stderr, flush=True)


def _us(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


def report(backend: str, sizes: tuple[int, int],
           rounds: list[dict[int, dict[str, list[float]]]]) -> list[str]:
    small, big = sizes
    lines = [f"| {backend} | p50 µs {label(small)} | p50 µs {label(big)} | {label(big)} / "
             f"{label(small)} | p99 µs {label(small)} | p99 µs {label(big)} |",
             "|---|---:|---:|---:|---:|---:|"]
    for op in OPERATIONS:
        p50 = {s: statistics.median(percentile(r[s][op], 0.5) for r in rounds) for s in sizes}
        p99 = {s: statistics.median(percentile(r[s][op], 0.99) for r in rounds) for s in sizes}
        ratio = statistics.median(
            percentile(r[big][op], 0.5) / percentile(r[small][op], 0.5) for r in rounds)
        lines.append(f"| {op} | {_us(p50[small])} | {_us(p50[big])} | {ratio:.2f} "
                     f"| {_us(p99[small])} | {_us(p99[big])} |")
    return lines


def purge_rounds(backend: str, size: int, args: argparse.Namespace) -> None:
    """Purge beside acquire (benchmarks/rows_purge.py), --purge-rounds rounds for each
    --purge-batch size, the large table filled again before each."""
    db_alias = alias(backend, size)
    if not args.only_events:
        print(f"\npurge beside acquire ({label(size)} idle rows; medians of rounds)\n")
        print(rows_purge.table_head())
    for batch in [] if args.only_events else args.purge_batch:
        for rest in args.purge_rest:
            rounds = []
            for round_no in range(args.purge_rounds):
                fill(db_alias, size)
                rounds.append(rows_purge.one_round(
                    db_alias, lambda n: measure(db_alias, n // 10, n), args.cycles, batch,
                    rest))
                _progress(f"{backend} purge round {round_no + 1}: "
                          f"{rows_purge.table_row(backend, batch, rest, rounds[-1:])}")
            print(rows_purge.table_row(backend, batch, rest, rounds), flush=True)
    if args.purge_events:
        events_beside(backend, size, args)  # after the lock purge: its table is full again


def events_beside(backend: str, size: int, args: argparse.Namespace) -> None:
    """Audit retention beside acquire: --purge-events events over 30 days; round r deletes
    the events older than 30 - r days (one day's worth, as a daily retention run does),
    so the history is filled once."""
    db_alias = alias(backend, size)
    fill(db_alias, size)
    rows_admin.fill_events(db_alias, args.purge_events, size)
    print(f"\naudit retention beside acquire ({args.purge_events:,} events over 30 days, "
          "each round deletes the oldest day's)\n")
    print(rows_purge.table_head())
    days = 30
    for rest in args.purge_rest:
        rounds = []
        for _ in range(args.purge_rounds):
            days -= 1  # every round its own day, oldest first
            rounds.append(rows_purge.one_round(
                db_alias, lambda n: measure(db_alias, n // 10, n), args.cycles,
                args.purge_batch[0], rest, events_days=days))
        print(rows_purge.table_row(backend, args.purge_batch[0], rest, rounds), flush=True)


def run_backend(backend: str, sizes: tuple[int, int], args: argparse.Namespace) -> None:
    from django.db import connections

    for size in sizes:
        fill(alias(backend, size), size)
        token_index(alias(backend, size), args.token_index)
    if args.only_purge:
        purge_rounds(backend, sizes[1], args)
        connections.close_all()
        return
    before = hot_counts(alias(backend, sizes[1]))
    rounds: list[dict[int, dict[str, list[float]]]] = []
    for round_no in range(args.rounds):
        order = sizes if round_no % 2 == 0 else sizes[::-1]
        rounds.append({size: measure(alias(backend, size), args.firsts, args.cycles)
                       for size in order})
        _progress(f"{backend} round {round_no + 1}/{args.rounds}")
    connections[alias(backend, sizes[1])].close()  # a session's exit flushes its counts
    after = hot_counts(alias(backend, sizes[1]))
    print(f"\n{backend}: {label(sizes[0])} vs {label(sizes[1])} lock rows, {args.rounds} "
          f"round(s) of {args.firsts} first uses and {args.cycles} cycles\n")
    print("\n".join(report(backend, sizes, rounds)))
    if before is not None and after is not None:
        upd, hot = after[0] - before[0], after[1] - before[1]
        share = hot / upd if upd else 0.0
        print(f"\nHOT updates of distlock_lock during the run ({label(sizes[1])} table): "
              f"{hot:,} of {upd:,} = {share:.1%} (all time: {after[1]:,} of {after[0]:,})")
    if not args.no_admin:
        admin_pages(backend, sizes, args)
    if not args.no_purge:
        purge_rounds(backend, sizes[1], args)
    connections.close_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1,000 vs 20,000 rows, one short round: proves it runs")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--firsts", type=int, default=300, help="first uses per round")
    parser.add_argument("--cycles", type=int, default=500, help="cycles per round")
    parser.add_argument("--big", type=int, default=1_000_000, help="rows of the large table")
    parser.add_argument("--no-purge", action="store_true", help="skip purge beside acquire")
    parser.add_argument("--no-admin", action="store_true", help="skip the admin pages")
    parser.add_argument("--no-admin-defaults", action="store_true",
                        help="skip the admin pages with Django's defaults (whole counts)")
    parser.add_argument("--skip-pages", default="",
                        help="skip these admin pages, labels as printed separated by ';' "
                             "(e.g. 'events: kind = stale write': seconds at 10M events)")
    parser.add_argument("--admin-repeat", type=int, default=5, help="timed fetches per page")
    parser.add_argument("--events", type=int, default=None,
                        help="audit events of the large table for the admin pages "
                             "(default 10,000,000; 20,000 with --quick; 0: none)")
    parser.add_argument("--token-index", action="store_true",
                        help="measure with an index on token (the alternative to the floor)")
    parser.add_argument("--only-purge", action="store_true",
                        help="only purge beside acquire (no operation rounds, no admin)")
    parser.add_argument("--purge-rounds", type=int, default=3,
                        help="rounds of purge beside acquire (each refills the table)")
    parser.add_argument("--purge-batch", default=None,
                        help="batch sizes to compare, e.g. 250,1000 (default PURGE_BATCH)")
    parser.add_argument("--purge-rest", default=None,
                        help="rests between batches to compare, as multiples of the batch's "
                             "time, e.g. 0,1 (default: PURGE_REST)")
    parser.add_argument("--only-events", action="store_true",
                        help="with --only-purge: audit retention only, not the lock purge")
    parser.add_argument("--purge-events", type=int, default=0,
                        help="audit events for audit retention beside acquire (0: skip)")
    parser.add_argument("--db-suffix", default="",
                        help="appended to the databases' names (runs that must not share)")
    parser.add_argument("--sqlite-dir", default=None,
                        help="keep the SQLite files in this folder between runs (default: "
                             "a temporary folder, filled again each run)")
    args = parser.parse_args(argv)
    from distlock.constants import PURGE_BATCH

    try:
        args.purge_batch = [int(b) for b in (args.purge_batch or str(PURGE_BATCH)).split(",")]
        # None: distlock's own (PURGE_REST, distlock/core/batches.py).
        args.purge_rest = ([None] if args.purge_rest is None
                           else [float(r) for r in args.purge_rest.split(",")])
    except ValueError:
        parser.error("--purge-batch / --purge-rest: numbers, e.g. 250,1000 / 0,1")
    if args.quick:
        args.rounds, args.firsts, args.cycles, args.big = 1, 30, 50, 20_000
        args.admin_repeat, args.purge_rounds = 1, 1
    if args.events is None:
        args.events = 20_000 if args.quick else 10_000_000
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or set(backends) - set(BACKENDS):
        parser.error(f"--backends: choose from {', '.join(BACKENDS)}")
    if (args.rounds < 1 or args.firsts < 1 or args.cycles < 1 or args.big < 2000
            or args.purge_rounds < 1 or min(args.purge_batch) < 1
            or min(r or 0 for r in args.purge_rest) < 0):
        parser.error("need --rounds, --firsts, --cycles, --purge-rounds, --purge-batch ≥ 1 "
                     "and --big ≥ 2000")
    sizes = (1000, args.big)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="distlock-rows-") as temporary:
        folder = args.sqlite_dir or temporary
        if args.sqlite_dir:
            os.makedirs(folder, exist_ok=True)
        configure(backends, sizes, folder, args.db_suffix)
        print(f"## distlock rows benchmark\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
              f", load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for backend in backends:
            run_backend(backend, sizes, args)
    print(f"\n({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
