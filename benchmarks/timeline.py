#!/usr/bin/env python
"""The timeline picture's admin pages over a large audit history (issue 17: every
operator view under 150 ms with 10M audit events).

    python benchmarks/timeline.py                          # 10M events, PostgreSQL
    python benchmarks/timeline.py --backends postgresql mariadb sqlite --events 1000000

The history, filled once by server-side statements and kept between runs (database
``distlock_bench_events_<size>``): 80 % of the events spread over 100,000 names and the
last 30 days, 10 % on one hot lock within the last 24 hours, 10 % on one lock that was
busy a month ago and has had nothing since (its events are all outside the picture's
window). Pages are timed through Django's test client, warm, median of ``--repeat``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import databases as dbs  # noqa: E402
from benchmarks import rows_admin  # noqa: E402

DAY_US = 86_400_000_000
NAMES = 100_000
_SEQ = {
    "postgresql": "SELECT i FROM generate_series(0::bigint, {last}) AS i",
    "mysql": "SELECT seq AS i FROM seq_0_to_{last}",
    "sqlite": "WITH RECURSIVE s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s "
              "WHERE i < {last}) SELECT i FROM s",
}
_CONCAT = {"postgresql": "'{prefix}' || (i % {names})", "sqlite": "'{prefix}' || (i % {names})",
           "mysql": "CONCAT('{prefix}', i % {names})"}


def configure(backends: list[str], size: int, folder: str) -> None:
    import django
    from django.conf import settings

    name = f"distlock_bench_events_{size}"
    databases: dict[str, Any] = {}
    if "postgresql" in backends:
        databases["postgresql"] = {**dbs.pg_settings(), "NAME": name}
    if "mariadb" in backends:
        databases["mariadb"] = {**dbs.maria_settings(), "NAME": name}
    if "sqlite" in backends:
        databases["sqlite"] = dbs.sqlite_settings(f"{folder}/{name}.sqlite3")
    databases["default"] = next(iter(databases.values()))
    settings.configure(
        DATABASES=databases, INSTALLED_APPS=["django.contrib.contenttypes", *rows_admin.APPS,
                                             "distlock"],
        USE_TZ=True, SECRET_KEY="bench", DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        DEBUG=False, **rows_admin.SETTINGS,
    )
    django.setup()


def _insert(cursor: Any, vendor: str, count: int, prefix: str, names: int, newest_us: int,
            span_us: int) -> None:
    seq = _SEQ[vendor].format(last=count - 1)
    name = _CONCAT[vendor].format(prefix=prefix, names=names)
    columns = ", ".join(cursor.db.ops.quote_name(c) for c in (
        "at_us", "kind", "name", "token", "owner", "holder", "by", "detail"))  # BY: reserved
    cursor.execute(
        f"INSERT INTO distlock_lockevent ({columns}) "
        f"SELECT {newest_us} - (i * {span_us // count}), "
        "CASE WHEN i % 3 = 0 THEN 'released' WHEN i % 3 = 1 THEN 'renewed' "
        f"ELSE 'acquired' END, {name}, i, '', 'bench', '', '' FROM ({seq}) AS q"
    )


def fill(alias: str, size: int) -> None:
    from django.core.management import call_command
    from django.db import connections

    from benchmarks.rows import create_database
    from distlock.db import db_now_us

    create_database(alias)
    call_command("migrate", database=alias, verbosity=0, interactive=False)
    connection = connections[alias]
    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM distlock_lockevent")
        if cursor.fetchone()[0] == size:
            return
        cursor.execute("DELETE FROM distlock_lockevent")
        now = db_now_us(alias)
        print(f"  … {alias}: filling {size:,} events", file=sys.stderr, flush=True)
        started = time.monotonic()
        tenth = size // 10
        _insert(cursor, connection.vendor, size - 2 * tenth, "fill:", NAMES, now, 30 * DAY_US)
        _insert(cursor, connection.vendor, tenth, "hot", 1, now, DAY_US)
        _insert(cursor, connection.vendor, tenth, "old", 1, now - 25 * DAY_US, 5 * DAY_US)
        if connection.vendor == "postgresql":
            cursor.execute("VACUUM ANALYZE distlock_lockevent")
        elif connection.vendor == "mysql":
            cursor.execute("ANALYZE TABLE distlock_lockevent")
        else:
            cursor.execute("ANALYZE")
        print(f"  … filled in {time.monotonic() - started:.0f} s", file=sys.stderr)


def pages() -> dict[str, str]:
    from django.urls import reverse

    url = reverse("admin:distlock_lock_timeline")
    return {
        "a lock with ~80 events": f"{url}?name=fill:42",
        "the hot lock (10 % of events, last 24 h)": f"{url}?name=hot0",
        "a lock busy a month ago (10 %, none in 24 h)": f"{url}?name=old0",
        "three locks on one axis": f"{url}?name=fill:42&name=hot0&name=old0",
        "Lock events changelist": reverse("admin:distlock_lockevent_changelist"),
    }


def time_pages(alias: str, repeat: int) -> dict[str, float]:
    from django.contrib.auth.models import User
    from django.test import Client, override_settings

    user = User.objects.filter(username="bench").first() or User.objects.create_superuser(
        "bench", "bench@example.com", "bench")
    got = {}
    with override_settings(DISTLOCK_DATABASE=alias):
        client = Client()
        client.force_login(user)
        for label, url in pages().items():
            times = []
            for i in range(repeat + 2):
                started = time.perf_counter()
                response = client.get(url)
                assert response.status_code == 200, (url, response.status_code)
                if i >= 2:
                    times.append((time.perf_counter() - started) * 1000)
            got[label] = statistics.median(times)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["postgresql"],
                        choices=["postgresql", "mariadb", "sqlite"])
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        configure(args.backends, args.events, folder)
        for backend in args.backends:
            fill(backend, args.events)
            got = time_pages(backend, args.repeat)
            print(f"\n| timeline pages ({backend}, {args.events:,} events) | median ms |\n"
                  "|---|---:|")
            for label, ms in got.items():
                print(f"| {label} | {ms:.1f} |")


if __name__ == "__main__":
    main()
