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
    lines = [
        f"distlock: database {_SERVER.get('database')}; Django {django.__version__}; "
        f"Celery broker {_SERVER.get('broker')}"
    ]
    if settings.PGBOUNCER:
        port = settings.DATABASES["default"]["PORT"]
        lines.append(
            f"distlock: through PgBouncer at 127.0.0.1:{port} in transaction pooling mode; "
            f"DISTLOCK_WAKEUPS = {settings.DISTLOCK_WAKEUPS}, "
            f"DISTLOCK_PREPARE_STATEMENTS = {settings.DISTLOCK_PREPARE_STATEMENTS}"
        )
    return lines


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The PgBouncer pass skips, loudly and with the reason, what needs a session of its own
    (``@pytest.mark.no_pooler(reason)``): docs/deployment.md lists them."""
    if not settings.PGBOUNCER:
        return
    for item in items:
        marker = item.get_closest_marker("no_pooler")
        if marker is not None:
            item.add_marker(pytest.mark.skip(reason=f"transaction pooling: {marker.args[0]}"))


_SWEEP: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def pgbouncer_strands_nothing(request: pytest.FixtureRequest):
    """The PgBouncer pass: after the last test, no pooled server connection of the test
    database holds a LISTEN, an advisory lock, a prepared statement, a SET or an open
    transaction (tests/support/pgbouncer.py's sweep), or the run fails. Then PgBouncer
    lets go of its server connections (KILL, RESUME), so Django can drop the database."""
    if not settings.PGBOUNCER:
        yield
        return
    request.getfixturevalue("django_db_setup")
    yield
    from django.db import connections

    from tests.support.pgbouncer import Server, admin, sweep

    connections.close_all()
    port = int(settings.DATABASES["default"]["PORT"])
    server = Server.from_url(settings.PGBOUNCER)
    name = str(settings.DATABASES["default"]["NAME"])
    try:
        found = sweep(port, server, name)
        _SWEEP.append(f"distlock through PgBouncer, test database {name}: {found.summary()}")
        assert not found.stranded, found.summary()
    finally:
        admin(port, server.user, f'KILL "{name}"')
        admin(port, server.user, f'RESUME "{name}"')


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _SWEEP:
        terminalreporter.write_line(line)


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
