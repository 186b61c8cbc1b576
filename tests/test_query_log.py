"""distlock's statements in Django's query log (DEBUG, CaptureQueriesContext, the
``django.db.backends`` logger), on every backend.

Under the log the lock operations keep their lean cursor and log each statement
themselves (distlock.backends.lean_cursor.LoggedCursor): Django's debug cursor rendered
every statement through the driver and doubled the client CPU of a cycle under
``DEBUG = True`` (docs/performance.md). What the log must still show is pinned here.
"""

from __future__ import annotations

import logging

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from distlock import acquire
from distlock.backends import backend_for
from distlock.backends.lean_cursor import LoggedCursor, sql_literal

pytestmark = pytest.mark.usefixtures("lock_db")


def test_every_lock_operation_is_in_the_query_log_with_its_values_and_time():
    with CaptureQueriesContext(connection) as captured:
        lease = acquire("logged:it's", ttl=30, blocking=False)
        assert lease is not None
    grant = captured.captured_queries
    assert grant, "the grant's statements are not in the query log"
    # The name goes in as an SQL literal (quote doubled), and each entry has its time.
    assert any("'logged:it''s'" in q["sql"] for q in grant), grant
    assert all(float(q["time"]) >= 0 for q in grant)
    with CaptureQueriesContext(connection) as captured:
        lease.renew()
    assert any(f"'{lease.owner}'" in q["sql"] for q in captured.captured_queries)
    with CaptureQueriesContext(connection) as captured:
        assert lease.release() is True
    released = captured.captured_queries
    assert any(f"'{lease.owner}'" in q["sql"] and str(lease.token) in q["sql"]
               for q in released), released


def test_the_statements_go_to_the_django_db_backends_logger(caplog):
    connection.ensure_connection()  # MariaDB's session set-up statements before, not in
    with caplog.at_level(logging.DEBUG, logger="django.db.backends"), \
            CaptureQueriesContext(connection) as captured:
        lease = acquire("logged:logger", ttl=30, blocking=False)
        assert lease is not None
        lease.release()
    records = [r for r in caplog.records if r.name == "django.db.backends"]
    logged = [q["sql"] for q in captured.captured_queries]
    assert [r.sql for r in records] == logged  # type: ignore[attr-defined]
    assert all(r.alias == connection.alias and r.duration >= 0  # type: ignore[attr-defined]
               for r in records)


def test_under_the_log_the_lean_cursor_logs_instead_of_djangos_debug_cursor():
    connection.ensure_connection()
    backend = backend_for(connection)
    lean = type(backend.statement_cursor(connection))
    with CaptureQueriesContext(connection):
        cursor = backend.statement_cursor(connection)
    assert type(cursor) is LoggedCursor
    assert type(cursor.lean) is lean


@pytest.mark.parametrize(("value", "literal"), [
    (None, "NULL"), (True, "true"), (False, "false"), (42, "42"), (1.5, "1.5"),
    ("a'b", "'a''b'"), ("", "''"),
])
def test_values_are_written_into_the_logged_sql_as_literals(value, literal):
    assert sql_literal(value) == literal
