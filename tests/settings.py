"""Test settings. DISTLOCK_TEST_BACKEND picks the database: sqlite (default),
postgresql or mariadb. Server addresses come from DISTLOCK_TEST_POSTGRES and
DISTLOCK_TEST_MARIADB (URLs), with the local defaults below.

DISTLOCK_TEST_PGBOUNCER (set by scripts/pgbouncer) says that DISTLOCK_TEST_POSTGRES is a
transaction-pooling PgBouncer in front of the server at that URL: the suite then runs with
the settings docs/deployment.md gives for that case, and tests/conftest.py proves at the
end that nothing was left on a pooled server connection.

Child processes spawned by tests (tests/support/processes.py) get DISTLOCK_TEST_CHILD_DB, the name
of the test database the parent created, and use it as it is. DISTLOCK_TEST_DB_SETTINGS (a JSON
object) replaces keys of the default database's settings where a URL cannot say them: the
failover tests (tests/support/pg_clusters.py) give a HOST and PORT list and OPTIONS.
"""

from __future__ import annotations

import json
import os
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
BACKEND = os.environ.get("DISTLOCK_TEST_BACKEND", "sqlite")
# Lets several test runs share one server without sharing a test database.
SUFFIX = os.environ.get("DISTLOCK_TEST_DB_SUFFIX", "")
CHILD_DB = os.environ.get("DISTLOCK_TEST_CHILD_DB")


def from_url(url: str, engine: str) -> dict[str, object]:
    parts = urlsplit(url)
    return {
        "ENGINE": engine,
        "NAME": parts.path.lstrip("/") or "test",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


if BACKEND == "sqlite":
    data = BASE_DIR / ".test-data"
    data.mkdir(exist_ok=True)
    default: dict[str, object] = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(data / f"main{SUFFIX}.sqlite3"),
        "OPTIONS": {
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
            "init_command": "PRAGMA journal_mode=WAL;",
        },
        "TEST": {"NAME": str(data / f"test{SUFFIX}.sqlite3")},
    }
elif BACKEND == "postgresql":
    default = from_url(
        os.environ.get("DISTLOCK_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test"),
        "django.db.backends.postgresql",
    )
    default["TEST"] = {"NAME": f"test_distlock{SUFFIX}"}
elif BACKEND == "mariadb":
    default = from_url(
        os.environ.get("DISTLOCK_TEST_MARIADB", "mysql://root@127.0.0.1:3306/test"),
        "django.db.backends.mysql",
    )
    default["OPTIONS"] = {"charset": "utf8mb4"}
    # MariaDB's own default; Django's is READ COMMITTED. REPEATABLE READ is where gap locks
    # make "lock if it exists, else insert" deadlock, so the suite can run under both.
    if os.environ.get("DISTLOCK_TEST_ISOLATION"):
        default["OPTIONS"]["isolation_level"] = os.environ["DISTLOCK_TEST_ISOLATION"]
    default["TEST"] = {"NAME": f"test_distlock{SUFFIX}", "CHARSET": "utf8mb4"}
else:
    raise RuntimeError(f"DISTLOCK_TEST_BACKEND={BACKEND!r}: use sqlite, postgresql or mariadb")

# The PgBouncer pass (scripts/pgbouncer): docs/deployment.md's settings for a transaction
# pooler. DISTLOCK_TEST_PGBOUNCER_PREPARED=1: this PgBouncer keeps prepared statements per
# client (1.21+ with max_prepared_statements), so distlock may prepare its own.
PGBOUNCER = os.environ.get("DISTLOCK_TEST_PGBOUNCER", "")
if PGBOUNCER:
    if BACKEND != "postgresql":
        raise RuntimeError("DISTLOCK_TEST_PGBOUNCER needs DISTLOCK_TEST_BACKEND=postgresql")
    DISTLOCK_WAKEUPS = False
    DISTLOCK_PREPARE_STATEMENTS = os.environ.get("DISTLOCK_TEST_PGBOUNCER_PREPARED") == "1"
    # Django's own advice for transaction pooling: no WITH HOLD cursors for .iterator().
    default["DISABLE_SERVER_SIDE_CURSORS"] = True

# The failover tests' runs without the timeline follow (with distlock_failover, or neither).
if os.environ.get("DISTLOCK_TEST_FOLLOW_TIMELINE") == "0":
    DISTLOCK_FOLLOW_TIMELINE = False

if CHILD_DB:
    default["NAME"] = CHILD_DB
if os.environ.get("DISTLOCK_TEST_DB_SETTINGS"):
    default.update(json.loads(os.environ["DISTLOCK_TEST_DB_SETTINGS"]))

DATABASES = {
    "default": default,
    # The same database through a second connection, for distlock inside atomic().
    "locks": {**default, "TEST": {**default.get("TEST", {}), "MIRROR": "default"}},
}

SECRET_KEY = "distlock-tests"
# The ASGI server of tests/test_asgi.py runs with these settings and DEBUG off.
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.admin",
    # Lets the live server of the browser test serve the admin's CSS and JavaScript.
    "django.contrib.staticfiles",
    "distlock",
    "tests.testapp",
    "tests.stressapp",
    # Django Tasks (tests/test_tasks.py): the database backend its db_worker runs.
    "django_tasks_db",
    # The demo's account and its async view (tests/test_asgi.py serves it).
    "demo_project.bank",
]
# Django 6 has the Tasks framework built in; on 5.2 it is the django-tasks backport.
TASKS_FRAMEWORK = "django.tasks" if find_spec("django.tasks") else "django_tasks"
if TASKS_FRAMEWORK == "django_tasks":
    INSTALLED_APPS.append("django_tasks")
TASKS = {
    # QUEUES [] accepts any queue name: a test's workers can have a queue of their own.
    "default": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": []},
    "immediate": {
        "BACKEND": f"{TASKS_FRAMEWORK}.backends.immediate.ImmediateBackend", "QUEUES": [],
    },
}
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "static/"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
