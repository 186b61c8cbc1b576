#!/usr/bin/env python
"""The cost of one enqueue_once() call (distlock/integrations/unique.py), per database.

    python benchmarks/enqueue_once.py                      # PostgreSQL, MariaDB, SQLite
    python benchmarks/enqueue_once.py --backends sqlite --calls 500
    python benchmarks/enqueue_once.py --quick              # 50 calls each

Three cases, each ``--calls`` calls, the median and p95 of one call's wall time:

- **sends**: a new key each call, outside any transaction: the key row inserted and
  locked, the transaction committed, the Celery task published (on_commit);
- **covered**: the same key again while its task is queued: the row locked, read, and the
  call returns False (no send), its own transaction committed;
- **covered, inside atomic()**: the same, with the caller's transaction already open (its
  commit, after the call, is not counted: it is the caller's).

The Celery broker is Redis (DISTLOCK_BENCH_REDIS, default redis://127.0.0.1:6379/15), a
queue of this run that no worker reads, deleted at the end. The databases are the
benchmark's own (benchmarks/databases.py): ``distlock_bench_unique`` on PostgreSQL and
MariaDB, a temporary file for SQLite. Each backend runs in a process of its own (Django is
configured once per process). Not part of .ci/run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import databases as dbs  # noqa: E402

BACKENDS = ("postgresql", "mariadb", "sqlite")
DB_NAME = "distlock_bench_unique"


def settings_for(backend: str, folder: str) -> dict[str, Any]:
    if backend == "postgresql":
        dbs.create_pg(name=DB_NAME)
        return {**dbs.pg_settings(), "NAME": DB_NAME}
    if backend == "mariadb":
        dbs.create_maria(name=DB_NAME)
        return {**dbs.maria_settings(), "NAME": DB_NAME}
    return dbs.sqlite_settings(f"{folder}/unique.sqlite3")


def measure(backend: str, calls: int) -> dict[str, Any]:
    """One backend's three cases, in this process."""
    with tempfile.TemporaryDirectory() as folder:
        dbs.setup_django({"default": settings_for(backend, folder)})
        from celery import Celery
        from django.core.management import call_command
        from django.db import transaction

        from distlock.integrations.unique import enqueue_once, unique_task
        from distlock.models import TaskKey

        call_command("migrate", "distlock", verbosity=0)
        queue = f"distlock-bench-unique-{uuid.uuid4().hex[:8]}"
        app = Celery("bench_unique", broker=dbs.REDIS_URL, set_as_current=False)
        app.conf.update(task_default_queue=queue, task_ignore_result=True)

        @app.task(name="bench.unique")
        @unique_task
        def body(key: str) -> None:
            """Never run: nothing reads the queue."""

        def timed(call: Any) -> float:
            start = time.perf_counter()
            call()
            return time.perf_counter() - start

        run = uuid.uuid4().hex[:8]
        TaskKey.objects.all().delete()
        enqueue_once(f"warm:{run}", body, ["warm"], ttl=600)  # connections, the pool
        sends = [
            timed(lambda i=i: enqueue_once(f"s:{run}:{i}", body, [str(i)], ttl=600))
            for i in range(calls)
        ]
        key = f"c:{run}"
        assert enqueue_once(key, body, [key], ttl=600) is True
        covered = [timed(lambda: enqueue_once(key, body, [key], ttl=600)) for _ in range(calls)]
        inside = []
        for _ in range(calls):
            with transaction.atomic():
                inside.append(timed(lambda: enqueue_once(key, body, [key], ttl=600)))
        TaskKey.objects.all().delete()
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
    return {"backend": backend, "calls": calls, **{
        name: {"median_ms": statistics.median(v) * 1e3,
               "p95_ms": statistics.quantiles(v, n=20)[-1] * 1e3}
        for name, v in (("sends", sends), ("covered", covered), ("inside", inside))
    }}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="50 calls per case")
    parser.add_argument("--one", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    calls = 50 if args.quick else args.calls
    if args.one:
        print(json.dumps(measure(args.one, calls)))
        return
    print(f"enqueue_once(), {calls} calls per case, Redis broker; median (p95), ms\n")
    print("| database | sends a task | covered by an existing key | covered, inside atomic() |")
    print("|---|---:|---:|---:|")
    for backend in args.backends:
        out = subprocess.run(
            [sys.executable, __file__, "--one", backend, "--calls", str(calls)],
            check=True, capture_output=True, text=True,
        ).stdout
        found = json.loads(out.strip().splitlines()[-1])
        cells = [
            f"{found[case]['median_ms']:.1f} ({found[case]['p95_ms']:.1f})"
            for case in ("sends", "covered", "inside")
        ]
        print(f"| {backend} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
