"""distlock through a transaction-pooling PgBouncer (the PgBouncer pass: scripts/pgbouncer).

Behind such a pooler each transaction may run on another server connection, and whatever
a client leaves on a session (LISTEN, an advisory lock, a prepared statement, a SET) stays
there for the next client of the pool. The suite's PgBouncer pass ends with a sweep of
every pooled server connection (tests/conftest.py); these tests show that the sweep sees
each kind of such state (so its "none" means something), and that waiting in contention
— processes, coroutines, the doctor's probe — with the documented settings leaves none.
"""

from __future__ import annotations

import contextlib
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from distlock.waiting.listener import channel
from tests.support.pgbouncer import WAKEUP_CLASS, Server, Sweep, sweep

pytestmark = [
    pytest.mark.usefixtures("lock_db"),
    pytest.mark.skipif(
        not settings.PGBOUNCER,
        reason="the PgBouncer pass only (scripts/pgbouncer sets DISTLOCK_TEST_PGBOUNCER)",
    ),
]

ASYNC = "tests.support.async_workers:"


def pooled_sweep(reset: bool = False) -> Sweep:
    return sweep(int(connection.settings_dict["PORT"]), Server.from_url(settings.PGBOUNCER),
                 str(connection.settings_dict["NAME"]), reset=reset)


def test_the_sweep_sees_each_kind_of_session_state_a_client_leaves_behind():
    pooler = Server("127.0.0.1", int(connection.settings_dict["PORT"]),
                    Server.from_url(settings.PGBOUNCER).user)
    with pooler.connect(str(connection.settings_dict["NAME"])) as raw:
        raw.execute("SELECT distlock_listen('stranded')")  # what an async waiter does
        raw.execute("SET lock_timeout = '5s'")
        assert raw.pgconn.prepare(b"stranded_statement", b"SELECT 1").error_message == b""
    found = pooled_sweep(reset=True)
    text = "; ".join(found.stranded)
    assert f"LISTEN {channel('stranded')}" in text
    assert f"advisory locks {WAKEUP_CLASS}/" in text
    assert "prepared statements stranded_statement" in text
    assert "SET lock_timeout = 5s" in text
    assert found.servers, "no pooled server connection inspected"
    assert pooled_sweep().stranded == []  # reset cleared it, and the next sweep says so


def test_a_transaction_left_open_is_reported():
    pooler = Server("127.0.0.1", int(connection.settings_dict["PORT"]),
                    Server.from_url(settings.PGBOUNCER).user)
    with pooler.connect(str(connection.settings_dict["NAME"])) as raw:
        raw.autocommit = False
        pid = raw.execute("SELECT pg_backend_pid()").fetchone()[0]
        found = pooled_sweep()
        raw.rollback()
    assert f"server pid {pid}: idle in transaction after 'SELECT pg_backend_pid()'" in (
        found.stranded
    )
    assert pid not in found.servers  # pinned to its client: the sweep could not borrow it
    assert pooled_sweep().stranded == []


@pytest.mark.processes
def test_waiting_in_contention_through_the_pooler_leaves_nothing_behind(children):
    """Blocking acquires in processes (sync) and in coroutines of other processes (async)
    wait for one another through the pooler: exclusion holds, and afterwards no pooled
    server connection keeps a LISTEN, an advisory lock, a prepared statement or a SET."""
    procs = [children.start("hammer", "pooled", 10, 10.0, 3.0) for _ in range(3)]
    procs += [children.start(ASYNC + "ahammer", "pooled", 3, 4, 10.0, 3.0) for _ in range(2)]
    for proc in procs:
        proc.expect("ready", timeout=60)
    for proc in procs:
        proc.send("go")
    grants = []
    for proc, count in zip(procs, (10, 10, 10, 12, 12), strict=True):
        grants += [proc.expect("grant", timeout=120) for _ in range(count)]
        proc.expect("done", timeout=60)
        assert proc.finish() == 0
    tokens = sorted(grant["token"] for grant in grants)
    assert tokens == list(range(tokens[0], tokens[0] + 54)), "tokens skipped or repeated"
    assert all(grant["held"] for grant in grants)
    found = pooled_sweep()
    assert found.stranded == [], found.summary()
    assert found.servers


def test_the_doctors_probe_leaves_nothing_behind(settings):
    # With DISTLOCK_PREPARE_STATEMENTS on, the probe also prepares a statement.
    settings.DISTLOCK_PREPARE_STATEMENTS = True
    out = StringIO()
    with contextlib.suppress(CommandError):  # the verdict is test_commands.py's subject
        call_command("distlock_doctor", stdout=out, stderr=StringIO())
    assert "a transaction pooler (such as PgBouncer" in out.getvalue()
    found = pooled_sweep()
    assert found.stranded == [], found.summary()
