from __future__ import annotations

import socket
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import django
import pytest
from django.conf import settings
from django.db import connection

if TYPE_CHECKING:
    from distlock import Lease

_SERVER: dict[str, str] = {}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Reach every configured server before any test runs; stop the run if one is down.

    A server that is configured but unreachable fails the run (exit status 4) instead of
    letting its tests be skipped or error one by one.
    """
    try:
        # A raw driver connection: pytest-django blocks Django's own until tests run.
        raw = connection.get_new_connection(connection.get_connection_params())
        try:
            cursor = raw.cursor()
            if connection.vendor == "sqlite":
                cursor.execute("SELECT sqlite_version()")
            else:
                cursor.execute("SELECT version()")
            _SERVER["database"] = f"{connection.vendor} {cursor.fetchone()[0]}"
        finally:
            raw.close()
    except Exception as exc:
        pytest.exit(
            f"distlock tests: the {connection.vendor} database at "
            f"{settings.DATABASES['default'].get('HOST') or 'localhost'} is configured but "
            f"unreachable: {exc}",
            returncode=4,
        )

    from tests.support.celery_app import broker_url

    broker = broker_url()
    if broker.startswith("redis://"):
        address = urlsplit(broker)
        try:
            socket.create_connection((address.hostname, address.port or 6379), timeout=5).close()
        except OSError as exc:
            pytest.exit(f"distlock tests: Redis at {broker} is configured but unreachable: "
                        f"{exc}", returncode=4)
    _SERVER["broker"] = broker.split("//")[0] + "//" + (urlsplit(broker).netloc or "")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say what this run tests: vendor, server version, Django (and the Celery broker)."""
    return [
        f"distlock: database {_SERVER.get('database')}; Django {django.__version__}; "
        f"Celery broker {_SERVER.get('broker')}"
    ]


@pytest.fixture
def lock_db(transactional_db: None) -> str:
    """Committed transactions on the test database; returns the lock alias."""
    return "default"


@pytest.fixture
def lock_prefix() -> str:
    """The prefix of three_locks' lock names; a test module overrides it to pick its own."""
    return "job"


@pytest.fixture
def three_locks(lock_db: str, lock_prefix: str) -> tuple[Lease, Lease, Lease]:
    """Three locks, one in each state: ``<prefix>:held`` (holder worker-A, renewed once),
    ``<prefix>:expired`` (run out by the database clock, holder sleepy) and
    ``<prefix>:free`` (released)."""
    from distlock import acquire
    from tests.support.helpers import expired_lock

    held = acquire(f"{lock_prefix}:held", ttl=30, holder="worker-A")
    held.renew(ttl=30)
    expired = expired_lock(f"{lock_prefix}:expired")
    free = acquire(f"{lock_prefix}:free", ttl=30)
    free.release()
    return held, expired, free


@pytest.fixture
def children(lock_db: str):
    """Start real worker processes (tests/support/processes.py); all are killed afterwards."""
    from tests.support.processes import Children

    group = Children()
    try:
        yield group
    finally:
        group.close()


@pytest.fixture
def folding_name_column(lock_db: str):
    """MariaDB/MySQL: give distlock_lock.name a collation that folds case and accents for
    the test (as a table converted by hand might have), and its own one back afterwards.

    Returns the folding collation's name. Skips, saying why, on other databases.
    """
    if connection.vendor != "mysql":
        pytest.skip(f"MariaDB/MySQL only: column collations (this run: {connection.vendor})")
    from distlock.backends import backend_for

    original = backend_for(connection).name_collation(connection)
    folding = "utf8mb4_general_ci"
    alter = (
        "ALTER TABLE distlock_lock MODIFY name varchar(255) "
        "CHARACTER SET utf8mb4 COLLATE {} NOT NULL"
    )
    with connection.cursor() as cursor:
        cursor.execute(alter.format(folding))
    try:
        yield folding
    finally:
        with connection.cursor() as cursor:
            cursor.execute(alter.format(original))
