"""Settings for the demo: embedded defaults, servers through environment variables.

DATABASE_URL     sqlite:///path (default: demo.sqlite3 here), postgresql://…, mysql://…
CELERY_BROKER_URL  filesystem:// (default: a folder in the project, DEMO_BROKER_DIR),
                 redis://127.0.0.1:6379/0, amqp://guest:guest@127.0.0.1:5672//
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "distlock-demo-not-secret")
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
USE_TZ = True
# The zone of the demo's report (demo_project/bank/report.py, ZONE: UTC), so the admin
# and the report show one clock; without it the admin showed Django's default, Chicago.
TIME_ZONE = "UTC"


def database_from_url(url: str) -> dict[str, object]:
    """A DATABASES entry from sqlite:///path, postgresql://… or mysql://… (mariadb://…)."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": parts.path[1:] or str(BASE_DIR / "demo.sqlite3"),
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
                "init_command": "PRAGMA journal_mode=WAL;",
            },
        }
    engines = {
        "postgresql": "django.db.backends.postgresql",
        "postgres": "django.db.backends.postgresql",
        "mysql": "django.db.backends.mysql",
        "mariadb": "django.db.backends.mysql",
    }
    if parts.scheme not in engines:
        raise ValueError(f"DATABASE_URL scheme {parts.scheme!r} is not supported")
    entry: dict[str, object] = {
        "ENGINE": engines[parts.scheme],
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }
    if engines[parts.scheme].endswith("mysql"):
        entry["OPTIONS"] = {"charset": "utf8mb4"}
    return entry


DATABASES = {
    "default": database_from_url(
        os.environ.get("DATABASE_URL", f"sqlite:///{BASE_DIR / 'demo.sqlite3'}")
    )
}
# distlock gets its own connection to the same database, so on PostgreSQL and MariaDB
# locks work inside atomic(). On SQLite (the default here) one writer at a time is the
# database's rule, so a second connection cannot lock inside another's write
# transaction: distlock refuses it there (README, Transactions).
DATABASES["distlock"] = {**DATABASES["default"]}
DISTLOCK_DATABASE = "distlock"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "distlock",
    "demo_project.bank",
]
# Lock metrics at /metrics (demo_project/urls.py) when the prometheus extra is installed.
if find_spec("prometheus_client"):
    INSTALLED_APPS.append("distlock.contrib.prometheus")
# Django's Tasks framework (contention_demo --django-tasks): django-tasks-db stores the
# tasks and runs them with its db_worker. Django 6 has the framework built in; on 5.2 it
# is the django-tasks backport (both come with the tasks extra).
if find_spec("django_tasks_db"):
    INSTALLED_APPS.append("django_tasks_db")
    if not find_spec("django.tasks"):
        INSTALLED_APPS.append("django_tasks")
    # QUEUES [] accepts any queue name: each demo run has a queue of its own.
    TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": []}}
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "demo_project.urls"
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
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The audit history: the admin's timeline of each lock and the demo's HTML report draw it.
DISTLOCK_AUDIT = True

# Waiters poll at most every 0.1 s, so the demo's hand-overs are quick to watch.
DISTLOCK_POLL_MAX_INTERVAL = 0.1

# Celery (demo_project/celery.py reads the CELERY_* names). No result backend: the demo
# keeps its outcomes in its own tables (demo_project.bank.models.Attempt).
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://")
DEMO_BROKER_DIR = Path(os.environ.get("DEMO_BROKER_DIR", BASE_DIR / ".demo-broker"))
if CELERY_BROKER_URL.startswith("filesystem://"):
    # kombu's filesystem transport: producers and workers meet in one folder. It needs no
    # server, but is not crash-durable (a SIGKILLed worker's message is lost): a demo and
    # development default, not for production.
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(DEMO_BROKER_DIR / "queue"),
        "data_folder_out": str(DEMO_BROKER_DIR / "queue"),
        "control_folder": str(DEMO_BROKER_DIR / "control"),
        "polling_interval": 0.1,
    }
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1

# The demo's lock lease, in seconds (contention_demo --ttl passes it to its workers).
DEMO_LOCK_TTL = float(os.environ.get("DEMO_LOCK_TTL", "1.0"))
