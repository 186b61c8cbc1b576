#!/usr/bin/env python
"""What limits distlock's PostgreSQL figures against A, measured in one run (issue 15).

    python benchmarks/floor.py --db-suffix _floor                  # every part, both transports
    python benchmarks/floor.py --db-suffix _floor --part django    # 1 process, Django's floor
    python benchmarks/floor.py --db-suffix _floor --part python    # client CPU, one process
    python benchmarks/floor.py --db-suffix _floor --part index --shapes owned,none,brin

Part ``django`` (1 process): A's two statements on their own psycopg connection (the
reference), then the same statements through the layers of Django a Django app can use —
on the psycopg connection Django holds (``connection.connection``) with a plain prepared
psycopg cursor, with the cursor Django configures on it (client-side binding, nothing
prepared), and through ``connections[alias].cursor()`` (a new one per statement, as Django
code does) — then distlock's own statements on Django's connection by raw psycopg, and
distlock's public API with and without signal receivers. Client CPU per cycle
(``time.process_time``), the backend's CPU per cycle (``/proc/<pid>/schedstat``, so it runs
on the database's machine) and cycles/s, each as a ratio to A's in the same round.

Part ``python``: client CPU only, the rows A, A on Django's connection, distlock's
functions and distlock, in short blocks in turn in one process (less moved by the load).

Part ``index`` (8 processes on their own names): A, distlock, and A's statements on a copy
of ``distlock_lock`` (its columns, indexes and fillfactor), with each shape of the
owned-rows index of migration 0001 in turn — the shipped ``(name) WHERE owner > ''``,
none, and alternatives — built on ``distlock_lock`` and on the copy of this run's own
database only (never a migration). Per measurement the HOT share of the updates of each
table (``pg_stat_user_tables``: ``n_tup_hot_upd / n_tup_upd``).

Databases ``distlock_bench<suffix>`` (created, migrated and filled like run.py's); drop it
when done (``DROP DATABASE distlock_bench<suffix>``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import contenders as c  # noqa: E402
from benchmarks import cpu_split, run  # noqa: E402
from benchmarks import databases as dbs  # noqa: E402

COPY = "floor_lock"
# Index shapes that could serve "held now" (owner > '' AND expires_us > now).
SHAPES = {
    "owned": "(name) WHERE owner > ''",  # migration 0001's, shipped
    "none": None,
    "expires": "(expires_us) WHERE owner > ''",
    "brin": "USING brin (expires_us)",
}
TABLES = ("bench_lock", "distlock_lock", COPY)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` so far, in ns precision (schedstat's first field)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


# cpu_split's workers read the backend's CPU in clock ticks; schedstat is finer.
cpu_split.cpu_seconds = cpu_seconds


class _OnDjango(c.PgUpsert):
    """A's statements on the psycopg connection of Django's ``alias``."""

    def __init__(self, alias: str, label: str) -> None:
        super().__init__("")
        self.alias, self.label = alias, label

    def connect(self) -> None:
        from django.db import connections

        connection = connections[self.alias]
        connection.ensure_connection()
        self.django, self.conn = connection, connection.connection
        self.cur = self.open()

    def open(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        from django.db import connections

        connections.close_all()


class PreparedOnDjango(_OnDjango):
    """A plain psycopg cursor, prepared after 5 uses as on A's own connection: what
    distlock's lean cursor does."""

    def open(self) -> Any:
        import psycopg

        self.conn.prepare_threshold = 5  # psycopg's default; Django's is None (never)
        return psycopg.Cursor(self.conn)


class DjangoRawCursor(_OnDjango):
    """``connection.connection.cursor()``: the cursor class Django configures (client-side
    binding), nothing prepared."""

    def open(self) -> Any:
        return self.conn.cursor()


class DjangoCursor(_OnDjango):
    """``with connections[alias].cursor() as cursor``, a new one per statement."""

    def open(self) -> Any:
        return None

    def try_acquire(self, name: str) -> Any:
        owner = c.new_owner()
        with self.django.cursor() as cursor:
            cursor.execute(self.ACQUIRE, (name, owner, c.TTL_S))
            row = cursor.fetchone()
        return None if row is None else (name, owner, row[0])

    def release(self, handle: Any) -> None:
        with self.django.cursor() as cursor:
            cursor.execute(self.RELEASE, handle)


class DistlockNoReceivers(c.Distlock):
    """distlock's public API with every receiver of its signals disconnected."""

    def connect(self) -> None:
        from distlock import signals

        super().connect()
        for signal in (signals.lock_acquired, signals.lock_not_acquired,
                       signals.lock_released, signals.lock_renewed, signals.lock_lost):
            signal.receivers.clear()
            signal.sender_receivers_cache.clear()


class UpsertOnCopy(c.PgUpsert):
    """A's two statements on the copy of distlock_lock: its columns, indexes, fillfactor."""

    label = "A's statements on a copy of distlock_lock"
    NOW_US = "CAST(EXTRACT(EPOCH FROM now()) * 1000000 AS BIGINT)"
    ACQUIRE = (
        f"INSERT INTO {COPY} AS l (name, owner, token, holder, expires_us, renew_count) "
        f"VALUES (%s, %s, 1, '', {NOW_US} + %s * 1000000, 0) "
        "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, token = l.token + 1, "
        "expires_us = excluded.expires_us "
        f"WHERE l.expires_us < {NOW_US} OR l.owner = '' RETURNING token"
    )
    RELEASE = f"UPDATE {COPY} SET owner = '' WHERE name = %s AND owner = %s AND token = %s"


def configure(suffix: str, transports: list[str]) -> None:
    databases = {t + extra: dbs.pg_settings(suffix, t)
                 for t in transports for extra in ("", "_fn", "_dl")}
    databases["default"] = dbs.pg_settings(suffix)
    dbs.setup_django(databases)


def sql(statements: list[str]) -> list[Any]:
    """Run ``statements`` on the default alias (autocommit); the last one's rows."""
    from django.db import connection

    rows: list[Any] = []
    with connection.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement)
            rows = cursor.fetchall() if cursor.description else []
    connection.close()
    return rows


def make_copy() -> None:
    sql([f"DROP TABLE IF EXISTS {COPY}",
         f"CREATE TABLE {COPY} (LIKE distlock_lock INCLUDING ALL) WITH (fillfactor = 70)",
         f"INSERT INTO {COPY} SELECT * FROM distlock_lock",
         f"ANALYZE {COPY}"])
    # The copied owned-rows index has a generated name: dropped, set_shape makes its own.
    for (name,) in sql([f"SELECT indexname FROM pg_indexes WHERE tablename = '{COPY}' "
                        "AND indexdef LIKE '%WHERE%'"]):
        sql([f"DROP INDEX {name}"])


def set_shape(shape: str) -> None:
    """Give distlock_lock and the copy the owned-rows index of ``shape`` (or none)."""
    statements = ["DROP INDEX IF EXISTS distlock_lock_owned", "DROP INDEX IF EXISTS floor_owned"]
    if SHAPES[shape] is not None:
        statements += [f"CREATE INDEX distlock_lock_owned ON distlock_lock {SHAPES[shape]}",
                       f"CREATE INDEX floor_owned ON {COPY} {SHAPES[shape]}"]
    sql(statements)


def updates() -> dict[str, tuple[int, int]]:
    """table -> (n_tup_upd, n_tup_hot_upd), once the backends that ended have reported
    theirs (they flush their counts as they exit: read until two reads agree)."""
    query = ("SELECT relname, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
             f"WHERE relname IN {TABLES}")
    seen: dict[str, tuple[int, int]] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = {r[0]: (int(r[1]), int(r[2])) for r in sql([query])}
        if now == seen:
            break
        seen = now
        time.sleep(0.5)
    return seen


def maintain() -> None:
    sql([f"VACUUM {', '.join(TABLES)}", "CHECKPOINT"])


def part_django(suffix: str, transports: list[str], rounds: int, seconds: float) -> None:
    print(f"## Part 1: 1 process, {rounds} rounds of {seconds} s per row, medians; "
          f"load average {load()} at the start\n")
    from distlock import signals

    connected = {name: len(getattr(signals, name).receivers) for name in
                 ("lock_acquired", "lock_not_acquired", "lock_released")}
    print(f"Receivers connected by default (DISTLOCK_AUDIT off): {connected}\n")
    for transport in transports:
        conninfo = dbs.pg_conninfo(suffix, transport)
        rows: list[c.Contender] = [
            c.PgUpsert(conninfo),
            PreparedOnDjango(transport, "A on Django's psycopg connection, prepared cursor"),
            DjangoRawCursor(transport, "A on connection.connection.cursor() (Django's class)"),
            DjangoCursor(transport, "A through connections[alias].cursor()"),
            cpu_split.SqlFunctionsOnDjango(transport),
            c.Distlock(transport),
            DistlockNoReceivers(transport, "distlock, no signal receivers"),
        ]
        seen: dict[str, list[tuple[float, float, float]]] = {x.label: [] for x in rows}
        for round_no in range(rounds):
            maintain()
            for row in run.rotated(rows, round_no):
                seen[row.label].append(cpu_split.measure(row, 1, seconds))
        print(f"{transport}, load average {load()} at the end\n")
        table(seen, rows[0].label)


def part_python(suffix: str, transports: list[str], blocks: int, per: int) -> None:
    """Client CPU only, in this one process: short blocks of each row in turn, so the
    machine's load moves all rows alike (profile_cycle.py's method)."""
    print(f"## Part 1b: 1 process, client CPU µs/cycle, {blocks} blocks of {per} cycles per "
          f"row in turn, medians; load average {load()} at the start\n")
    name = f"floor:{os.getpid()}"
    for transport in transports:
        rows: list[c.Contender] = [
            c.PgUpsert(dbs.pg_conninfo(suffix, transport)),
            PreparedOnDjango(transport, "A on Django's psycopg connection, prepared cursor"),
            cpu_split.SqlFunctionsOnDjango(transport + "_fn"),
            c.Distlock(transport + "_dl"),
        ]
        seen: dict[str, list[float]] = {x.label: [] for x in rows}
        for row in rows:
            row.connect()
            for _ in range(300):  # warm-up: statements prepared, caches filled
                row.release(row.try_acquire(name))
        for block in range(blocks):
            for row in run.rotated(rows, block):
                began = time.process_time()
                for _ in range(per):
                    row.release(row.try_acquire(name))
                seen[row.label].append((time.process_time() - began) / per * 1e6)
        a = seen[rows[0].label]
        print(f"{transport}, load average {load()} at the end\n")
        print("| | client CPU µs/cycle | × A (median of the blocks' ratios) |\n|---|---:|---:|")
        for label, values in seen.items():
            ratio = statistics.median(m / r for m, r in zip(values, a, strict=True))
            print(f"| {label} | {statistics.median(values):.0f} | {ratio:.2f} |")
        print()
        for row in rows:
            row.close()


MEASURES = ("cycles/s", "client CPU µs/cycle", "backend CPU µs/cycle")


def table(seen: dict[str, list[tuple[float, ...]]], reference: str,
          hot: dict[str, list[float]] | None = None,
          measures: tuple[str, ...] = MEASURES) -> None:
    """One row per label: each of ``measures`` (the median of its runs), and the median
    of its ratios to ``reference``'s run of the same turn."""
    print("| |" + "".join(f" {measure} | × A |" for measure in measures)
          + (" HOT % |" if hot else ""))
    print("|---|" + "---:|---:|" * len(measures) + ("---:|" if hot else ""))
    ref = seen[reference]
    for label, runs in seen.items():
        cells = []
        for i in range(len(measures)):
            cells.append(f"{statistics.median(r[i] for r in runs):,.0f}")
            ratio = statistics.median(m[i] / a[i] for m, a in zip(runs, ref, strict=True))
            cells.append(f"{ratio:.2f}")
        if hot:
            cells.append(f"{statistics.median(hot[label]):.1f}")
        print(f"| {label} | {' | '.join(cells)} |")
    print()


def part_index(suffix: str, transports: list[str], rounds: int, seconds: float, procs: int,
               shapes: list[str]) -> None:
    print(f"## Part 2: {procs} processes on their own names, {rounds} rounds of {seconds} s "
          f"per row, medians; load average {load()} at the start\n")
    for transport in transports:
        conninfo = dbs.pg_conninfo(suffix, transport)
        rows: list[c.Contender] = [c.PgUpsert(conninfo), c.Distlock(transport),
                                   UpsertOnCopy(conninfo)]
        tables = dict(zip((r.label for r in rows), TABLES, strict=True))
        seen = {(s, r.label): [] for s in shapes for r in rows}  # type: ignore[var-annotated]
        hot: dict[tuple[str, str], list[float]] = {key: [] for key in seen}
        for round_no in range(rounds):
            for shape in run.rotated(shapes, round_no):
                set_shape(shape)
                for row in run.rotated(rows, round_no):
                    maintain()
                    before = updates()
                    seen[shape, row.label].append(cpu_split.measure(row, procs, seconds))
                    after = updates()
                    upd, hot_upd = (after[tables[row.label]][i] - before[tables[row.label]][i]
                                    for i in (0, 1))
                    hot[shape, row.label].append(100 * hot_upd / max(1, upd))
        print(f"{transport}, load average {load()} at the end; each row's HOT share is of "
              "its own table's updates; × A against A in the same round and shape\n")
        for shape in shapes:
            print(f"Owned-rows index: {SHAPES[shape] or 'none'}\n")
            table({r.label: seen[shape, r.label] for r in rows}, rows[0].label,
                  {r.label: hot[shape, r.label] for r in rows})
        base = shapes[0]
        for shape in shapes[1:]:
            for r in rows:
                pairs = list(zip(seen[shape, r.label], seen[base, r.label], strict=True))
                rate, client, backend = (statistics.median(m[i] / b[i] for m, b in pairs)
                                         for i in range(3))
                print(f"- {r.label}, with {shape} / with {base} (median of the rounds' "
                      f"ratios): cycles/s {rate:.2f}, client CPU {client:.2f}, "
                      f"backend CPU {backend:.2f}")
        print()
    set_shape("owned")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db-suffix", default="_floor")
    parser.add_argument("--part", choices=["django", "python", "index", "both"], default="both",
                        help="both: every part")
    parser.add_argument("--transport", choices=[*dbs.TRANSPORTS, "both"], default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--procs", type=int, default=8, help="part index's processes")
    parser.add_argument("--blocks", type=int, default=20, help="part python's blocks per row")
    parser.add_argument("--per", type=int, default=300, help="part python's cycles per block")
    parser.add_argument("--shapes", default="owned,none",
                        help=f"part index's index shapes, of {', '.join(SHAPES)}")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    if not set(shapes) <= set(SHAPES) or args.rounds < 1 or args.seconds <= 0:
        parser.error(f"--shapes from {', '.join(SHAPES)}; --rounds ≥ 1; --seconds > 0")
    transports = list(dbs.TRANSPORTS) if args.transport == "both" else [args.transport]
    configure(args.db_suffix, transports)
    dbs.create_pg(args.db_suffix)
    dbs.prepare("default", dbs.POOL)
    make_copy()
    set_shape("owned")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"database {dbs.pg_settings(args.db_suffix)['NAME']}\n")
    if args.part in ("django", "both"):
        part_django(args.db_suffix, transports, args.rounds, args.seconds)
    if args.part in ("python", "both"):
        part_python(args.db_suffix, transports, args.blocks, args.per)
    if args.part in ("index", "both"):
        part_index(args.db_suffix, transports, args.rounds, args.seconds, args.procs, shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
