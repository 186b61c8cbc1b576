#!/usr/bin/env python
"""What limits distlock's SQLite figure against A: the table, the statements or Python?

    python benchmarks/sqlite_floor.py                     # 20 blocks of 300 cycles per row
    python benchmarks/sqlite_floor.py --blocks 10 --per 500

One process, a name of its own, acquire → release cycles of the rows below in short blocks in
turn (so the machine's load moves all rows alike), on one SQLite file in WAL mode, as
``run.py`` sets it up (``databases.sqlite_settings``):

- A: the reference's upsert and update (``contenders.SqliteUpsert``) on its own 4-column
  table ``bench_lock``;
- A's two statements, their columns renamed, on ``bench_shape``: a copy of
  ``distlock_lock`` with its indexes (the owned-rows index of migration 0001 included),
  so the difference to A is what the table's shape costs;
- the same on the copy without the owned-rows index;
- distlock's own two statements (``backends/sqlite.py``'s grant of a free row and its
  release) sent by raw sqlite3 on the same file: the difference to the row above is what
  distlock's statements cost beyond A's;
- distlock's public API, ``acquire(blocking=False)`` + ``Lease.release()``: the
  difference to the row above is distlock's Python.

Per row: cycles/s of the wall clock and client CPU µs per cycle (``time.process_time``;
SQLite runs in this process, so it is all of SQLite's work but its waits for the disk),
each with the median over the blocks of its ratio to A's block in the same turn.
docs/performance.md has a run. The file is made in a temporary folder and removed.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import contenders as c  # noqa: E402
from benchmarks import databases as dbs  # noqa: E402
from benchmarks import floor, run  # noqa: E402
from distlock.backends.sqlite import NOW  # noqa: E402 - distlock's clock in µs

SHAPE = "bench_shape"
OWNED_INDEX = "bench_shape_owned"
MEASURES = ("cycles/s", "client CPU µs/cycle")


class _Raw(c.Contender):
    """Two statements by raw sqlite3 on the benchmark's file (autocommit, WAL)."""

    ACQUIRE = ""
    RELEASE = ""

    def __init__(self, path: str, label: str) -> None:
        self.path = path
        self.label = label

    def connect(self) -> None:
        self.conn = sqlite3.connect(self.path, timeout=5, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")

    def close(self) -> None:
        self.conn.close()


class AOnShape(_Raw):
    """A's upsert and update on the copy of distlock_lock (expiry in µs, as distlock's)."""

    ACQUIRE = (
        f"INSERT INTO {SHAPE} AS l (name, owner, holder, token, expires_us, renew_count) "
        f"VALUES (?, ?, '', 1, {NOW} + ?, 0) "
        "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, token = l.token + 1, "
        f"expires_us = excluded.expires_us WHERE l.expires_us < {NOW} OR l.owner = '' "
        "RETURNING token"
    )
    RELEASE = f"UPDATE {SHAPE} SET owner = '' WHERE name = ? AND owner = ? AND token = ?"

    def try_acquire(self, name: str) -> Any:
        owner = c.new_owner()
        row = self.conn.execute(self.ACQUIRE, (name, owner, int(c.TTL_S * 1e6))).fetchone()
        return None if row is None else (name, owner, row[0])

    def release(self, handle: Any) -> None:
        self.conn.execute(self.RELEASE, handle)


class DistlockStatements(_Raw):
    """distlock's grant of a free row and its release, rendered as the backend sends them."""

    def connect(self) -> None:
        from distlock.backends import sqlite as backend

        super().connect()
        self.ACQUIRE = backend._qmark(backend._render(backend._GRANT_FREE, NOW))
        self.RELEASE = backend._qmark(backend._render(backend._RELEASE, NOW))

    def try_acquire(self, name: str) -> Any:
        from distlock.constants import MAX_TOKEN

        owner = c.new_owner()
        row = self.conn.execute(
            self.ACQUIRE, (owner, "bench", int(c.TTL_S * 1e6), name, MAX_TOKEN)
        ).fetchone()
        return None if row is None else (name, owner, row[0])

    def release(self, handle: Any) -> None:
        self.conn.execute(self.RELEASE, handle).fetchone()


def make_shape(path: str, name: str) -> None:
    """``bench_shape`` (and its indexes) as ``distlock_lock``'s, holding the free ``name``."""
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {SHAPE}")
        for (sql,) in conn.execute(
            "SELECT sql FROM sqlite_master WHERE tbl_name = 'distlock_lock' AND sql IS NOT NULL "
            "ORDER BY type DESC"  # the table before its indexes
        ).fetchall():
            kind = "TABLE" if sql.upper().startswith("CREATE TABLE") else "INDEX"
            sql = sql.replace('"distlock_lock"', SHAPE).replace("distlock_lock", SHAPE)
            if kind == "INDEX":
                head, _, rest = sql.partition(" ON ")
                sql = f"{head.rsplit(' ', 1)[0]} {OWNED_INDEX} ON {rest}"
            conn.execute(sql)
        conn.execute(
            f"INSERT INTO {SHAPE} SELECT * FROM distlock_lock WHERE name <> ?", [name]
        )
        conn.execute(
            f"INSERT INTO {SHAPE} (name, token, owner, holder, expires_us, renew_count) "
            "VALUES (?, 0, '', '', 0, 0)", [name],
        )
    conn.close()


def drop_owned_indexes(path: str) -> None:
    """Drop the owned-rows index of the copy and of ``distlock_lock`` (migration 0001's)."""
    with sqlite3.connect(path, isolation_level=None) as conn:
        conn.execute(f"DROP INDEX IF EXISTS {OWNED_INDEX}")
        (index,) = conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' "
            "AND tbl_name = 'distlock_lock' AND sql LIKE '%WHERE%'"
        ).fetchone()
        conn.execute(f'DROP INDEX "{index}"')
    conn.close()


def measure(
    rows: list[c.Contender], name: str, blocks: int, per: int
) -> dict[str, list[tuple[float, ...]]]:
    seen: dict[str, list[tuple[float, ...]]] = {row.label: [] for row in rows}
    for row in rows:
        row.connect()
        for _ in range(300):  # warm-up
            row.release(row.try_acquire(name))
    for block in range(blocks):
        for row in run.rotated(rows, block):
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(per):
                row.release(row.try_acquire(name))
            seen[row.label].append(
                (per / (time.perf_counter() - wall), (time.process_time() - cpu) / per * 1e6)
            )
    for row in rows:
        row.close()
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--per", type=int, default=300)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="distlock-sqlite-floor-") as folder:
        path = os.path.join(folder, "bench.sqlite3")
        dbs.setup_django({"default": dbs.sqlite_settings(path)})
        dbs.prepare("default", 100)
        name = f"floor:{os.getpid()}"
        make_shape(path, name)
        from django.db import connections

        from distlock import acquire

        acquire(name, ttl=5, blocking=False).release()  # the row the raw statements grant
        connections.close_all()
        print(f"1 process, {args.blocks} blocks of {args.per} cycles per row in turn, medians; "
              f"SQLite {sqlite3.sqlite_version}; load average {floor.load()} at the start\n")
        rows: list[c.Contender] = [
            c.SqliteUpsert(path),
            AOnShape(path, "A's statements on a copy of distlock_lock"),
            DistlockStatements(path, "distlock's statements, raw sqlite3"),
            c.Distlock("default", "distlock"),
        ]
        floor.table(measure(rows, name, args.blocks, args.per), rows[0].label, measures=MEASURES)
        drop_owned_indexes(path)
        print("Without the owned-rows index (on the copy, and on distlock_lock):\n")
        rows = [
            c.SqliteUpsert(path),
            AOnShape(path, "A's statements on the copy, no owned-rows index"),
            DistlockStatements(path, "distlock's statements, no owned-rows index"),
        ]
        floor.table(measure(rows, name, args.blocks, args.per), rows[0].label, measures=MEASURES)
        print(f"load average {floor.load()} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
