"""Benchmark databases: their own names on each server, never the test databases.

PostgreSQL ``distlock_bench`` (and ``distlock_bench_1m`` for the scale check), MariaDB
``distlock_bench``, and a SQLite file in a temporary folder. Server addresses come from
DISTLOCK_BENCH_POSTGRES, DISTLOCK_BENCH_MARIADB and DISTLOCK_BENCH_REDIS (URLs).

PostgreSQL is reached over TCP (the URL's host and port) or over the server's Unix socket
(``transport="socket"``): the folder that holds ``.s.PGSQL.<port>``, from
DISTLOCK_BENCH_POSTGRES_SOCKET or else the first of /var/run/postgresql and /tmp that has
it. Over the socket a round trip costs less, so the client's Python shows more.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from benchmarks.contenders import MARIA_REF_TABLE, PG_REF_TABLE, SQLITE_REF_TABLE

PG_URL = os.environ.get(
    "DISTLOCK_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/distlock_bench"
)
MARIA_URL = os.environ.get("DISTLOCK_BENCH_MARIADB", "mysql://root@127.0.0.1:3306/distlock_bench")
REDIS_URL = os.environ.get("DISTLOCK_BENCH_REDIS", "redis://127.0.0.1:6379/15")
PG_SOCKET_DIRS = ("/var/run/postgresql", "/tmp")
TRANSPORTS = ("socket", "tcp")

POOL = 1000
BIG = 1_000_000


def setup_django(databases: dict[str, Any], **settings_: Any) -> None:
    """Configure Django for a benchmark of distlock and the bench app on ``databases``
    (``settings_`` added to the common settings), and set it up."""
    import django
    from django.conf import settings

    settings.configure(
        DATABASES=databases, USE_TZ=True, SECRET_KEY="bench", DEBUG=False,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "distlock",
                        "benchmarks.benchapp"],
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        **settings_,
    )
    django.setup()


def pool_names(size: int) -> list[str]:
    return [f"bench:{i:07d}" for i in range(size)]


def _parts(url: str) -> dict[str, str]:
    p = urlsplit(url)
    return {
        "NAME": p.path.lstrip("/"),
        "USER": unquote(p.username or ""),
        "PASSWORD": unquote(p.password or ""),
        "HOST": p.hostname or "",
        "PORT": str(p.port or ""),
    }


def pg_socket_dir() -> str:
    """The folder of PostgreSQL's Unix socket for the URL's port; SystemExit if none."""
    port = _parts(PG_URL)["PORT"] or "5432"
    configured = os.environ.get("DISTLOCK_BENCH_POSTGRES_SOCKET")
    for folder in (configured,) if configured else PG_SOCKET_DIRS:
        if os.path.exists(os.path.join(folder, f".s.PGSQL.{port}")):
            return folder
    where = configured or " or ".join(PG_SOCKET_DIRS)
    raise SystemExit(
        f"no PostgreSQL Unix socket .s.PGSQL.{port} in {where}: set "
        "DISTLOCK_BENCH_POSTGRES_SOCKET to the server's unix_socket_directories "
        "(`psql -c 'SHOW unix_socket_directories'`), or use --transport tcp"
    )


def pg_settings(suffix: str = "", transport: str = "tcp") -> dict[str, Any]:
    """Django's DATABASES entry for the benchmark database over ``transport``."""
    parts = _parts(PG_URL)
    parts["NAME"] += suffix
    if transport == "socket":
        parts["HOST"] = pg_socket_dir()
    elif transport != "tcp":
        raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
    return {"ENGINE": "django.db.backends.postgresql", **parts}


def pg_conninfo(suffix: str = "", transport: str = "tcp") -> str:
    s = pg_settings(suffix, transport)
    fields = {"host": s["HOST"], "port": s["PORT"], "user": s["USER"],
              "password": s["PASSWORD"], "dbname": s["NAME"]}
    return " ".join(f"{k}={v}" for k, v in fields.items() if v)


def maria_settings() -> dict[str, Any]:
    return {"ENGINE": "django.db.backends.mysql", **_parts(MARIA_URL),
            "OPTIONS": {"charset": "utf8mb4"}}


def maria_params() -> dict[str, Any]:
    s = maria_settings()
    params: dict[str, Any] = {"host": s["HOST"], "user": s["USER"], "database": s["NAME"]}
    if s["PORT"]:
        params["port"] = int(s["PORT"])
    if s["PASSWORD"]:
        params["password"] = s["PASSWORD"]
    return params


def sqlite_settings(path: str) -> dict[str, Any]:
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": path,
        # What distlock needs on SQLite (see the README), and the anchors' busy timeout.
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 5,
                    "init_command": "PRAGMA journal_mode=WAL"},
    }


def create_pg(suffix: str = "", *, name: str | None = None) -> None:
    """Create the PostgreSQL database (``name``, else the benchmark's with ``suffix``)."""
    import psycopg

    name = name or pg_settings(suffix)["NAME"]
    admin = pg_conninfo().replace(f"dbname={pg_settings()['NAME']}", "dbname=postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def create_maria(*, name: str | None = None) -> None:
    """Create the MariaDB database (``name``, else the benchmark's)."""
    import MySQLdb

    params = maria_params()
    name = name or params["database"]
    params.pop("database")
    conn = MySQLdb.connect(**params, charset="utf8mb4")
    try:
        conn.cursor().execute(
            f"CREATE DATABASE IF NOT EXISTS `{name}` CHARACTER SET utf8mb4"
        )
    finally:
        conn.close()


def prepare(alias: str, size: int) -> None:
    """Migrate ``alias`` and make sure both lock tables hold ``size`` pool rows (+ extras).

    New distlock rows start above the table's largest token, as distlock's own first use
    would; the reference table starts at 0.
    """
    from django.core.management import call_command
    from django.db import connections

    # run_syncdb: the benchmark app has no migrations, its table is made from the model.
    call_command("migrate", database=alias, verbosity=0, interactive=False, run_syncdb=True)
    from benchmarks.benchapp.models import BenchAccount

    for pk in range(1, 65):
        BenchAccount.objects.using(alias).get_or_create(pk=pk)
    connection = connections[alias]
    ref_table = {"postgresql": PG_REF_TABLE, "mysql": MARIA_REF_TABLE,
                 "sqlite": SQLITE_REF_TABLE}[connection.vendor]
    with connection.cursor() as cursor:
        cursor.execute(ref_table)
        cursor.execute("SELECT COUNT(*) FROM distlock_lock")
        have = cursor.fetchone()[0]
        extras = ["contended", *(f"own:{i}" for i in range(64))]
        if have >= size + len(extras):
            return
        cursor.execute("SELECT COALESCE(MAX(token), 0) FROM distlock_lock")
        top = cursor.fetchone()[0] + 1
        ignore = {"postgresql": ("INSERT INTO", " ON CONFLICT DO NOTHING"),
                  "mysql": ("INSERT IGNORE INTO", ""),
                  "sqlite": ("INSERT OR IGNORE INTO", "")}[connection.vendor]
        if connection.vendor == "postgresql":
            # Server-side generation: a million rows in a few seconds.
            for table, columns in (
                ("distlock_lock", f"'bench:' || lpad(i::text, 7, '0'), {top}, '', '', 0, 0"),
                ("bench_lock", "'bench:' || lpad(i::text, 7, '0'), '', 0, '-infinity'"),
            ):
                cols = ("(name, token, owner, holder, expires_us, renew_count)"
                        if table == "distlock_lock" else "(name, owner, token, expires_at)")
                cursor.execute(
                    f"INSERT INTO {table} {cols} SELECT {columns} "
                    f"FROM generate_series(0, {size - 1}) AS i ON CONFLICT DO NOTHING"
                )
            names = extras
        else:
            names = pool_names(size) + extras
        cursor.executemany(
            f"{ignore[0]} distlock_lock (name, token, owner, holder, expires_us, renew_count) "
            f"VALUES (%s, {top}, '', '', 0, 0){ignore[1]}",
            [(n,) for n in names],
        )
        cursor.executemany(
            f"{ignore[0]} bench_lock (name, owner, token) VALUES (%s, '', 0){ignore[1]}",
            [(n,) for n in names],
        )
        if connection.vendor == "postgresql":
            cursor.execute("ANALYZE distlock_lock")
            cursor.execute("ANALYZE bench_lock")


def maintain(alias: str) -> None:
    """Before a PostgreSQL measurement: VACUUM the lock tables and CHECKPOINT (anchors)."""
    from django.apps import apps
    from django.db import connections

    connection = connections[alias]
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute("VACUUM distlock_lock, bench_lock")
        if apps.is_installed("db_mutex"):
            cursor.execute("DELETE FROM db_mutex_dbmutex")
        # Needs superuser or pg_checkpoint; the local bench role is postgres.
        cursor.execute("CHECKPOINT")
    connection.close()
