"""Django for a lab worker process: distlock and the lab's Cell table on the lab database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent


def database(url: str) -> dict[str, Any]:
    """Django's DATABASES entry for a ``postgresql://user@host:port/name`` URL.

    libpq's multi-host form ``postgresql://user@h1:p1,h2:p2/name?target_session_attrs=
    read-write`` gives a HOST and a PORT list and the query's OPTIONS: a client of the
    PostgreSQL failover scenarios reaches whichever of the pair is the primary.
    """
    parts = urlsplit(url)
    user, _, hosts = parts.netloc.rpartition("@")
    user, _, password = user.partition(":")
    names, ports = [], []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "")
        names.append(unquote(name) or "127.0.0.1")  # a socket folder, percent-encoded
        ports.append(port or "5432")
    entry: dict[str, Any] = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(user),
        "PASSWORD": unquote(password),
        "HOST": ",".join(names),
        "PORT": ",".join(ports),
    }
    if parts.query:
        entry["OPTIONS"] = dict(parse_qsl(parts.query))
    return entry


def setup(url: str, *, follow: bool = True) -> None:
    """Django configured for the lab; ``follow``: DISTLOCK_FOLLOW_TIMELINE (the PostgreSQL
    failover scenarios turn it off in their variants with an operator step and without)."""
    import django
    from django.conf import settings

    settings.configure(
        DATABASES={"default": database(url)}, USE_TZ=True, SECRET_KEY="lab", DEBUG=False,
        DISTLOCK_FOLLOW_TIMELINE=follow,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "distlock",
                        "lab"],
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    )
    django.setup()


def create_database(url: str) -> None:
    """The lab database on the server of ``url``, created if missing."""
    import psycopg

    entry = database(url)
    admin = {"host": entry["HOST"], "port": entry["PORT"], "user": entry["USER"],
             "dbname": "postgres"}
    if entry["PASSWORD"]:
        admin["password"] = entry["PASSWORD"]
    with psycopg.connect(**admin, autocommit=True) as conn:
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                             (entry["NAME"],)).fetchone()
        if not found:
            conn.execute(f'CREATE DATABASE "{entry["NAME"]}"')


def migrate() -> None:
    """distlock's migrations and the lab's table (an app without migrations)."""
    from django.core.management import call_command

    call_command("migrate", run_syncdb=True, verbosity=0)


def migrate_in_child(url: str) -> None:
    """:func:`migrate` on the database at ``url``, in a lab worker process of its own (a
    process configures Django once, for one database)."""
    command = [sys.executable, "-m", "lab.worker", "--migrate", json.dumps({"postgres": url})]
    subprocess.run(command, check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                   timeout=300)
