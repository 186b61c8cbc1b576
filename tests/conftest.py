from __future__ import annotations

import django
import pytest
from django.conf import settings
from django.db import connection


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say what this run tests: vendor, server version, Django and Python.

    A configured server that cannot be reached fails the run here, before any test, rather
    than letting database tests be skipped or errored one by one.
    """
    try:
        connection.ensure_connection()
        with connection.cursor() as cursor:
            if connection.vendor == "sqlite":
                cursor.execute("SELECT sqlite_version()")
            else:
                cursor.execute("SELECT version()")
            version = cursor.fetchone()[0]
    except Exception as exc:
        raise pytest.UsageError(
            f"distlock tests: database {settings.DATABASES['default'].get('HOST') or ''}"
            f" ({connection.vendor}) is configured but unreachable: {exc}"
        ) from exc
    finally:
        connection.close()
    return [f"distlock: database {connection.vendor} {version}; Django {django.__version__}"]


@pytest.fixture
def lock_db(transactional_db: None) -> str:
    """Committed transactions on the test database; returns the lock alias."""
    return "default"


@pytest.fixture
def children(lock_db: str):
    """Start real worker processes (tests/processes.py); all are killed afterwards."""
    from tests.processes import Children

    group = Children()
    try:
        yield group
    finally:
        group.close()
