"""The timeline follow (distlock.ops.failover.follow_timeline): a new session on a server
whose timeline is not the one the token floor recorded raises every token once.

A real promotion is in tests/test_failover.py and tests/test_patroni.py; here the
promotion is simulated on the shared server by recording another timeline than the
server's (what a promoted standby finds: its primary's record), and each test opens new
sessions by closing Django's connection. On SQLite and MariaDB nothing is done.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from django.db import connection, connections

from distlock import acquire
from distlock.backends import backend_for
from distlock.ops.failover import DEFAULT_MARGIN
from distlock.signals import lock_broken
from tests.support.helpers import raw_postgres

pytestmark = pytest.mark.usefixtures("lock_db")

postgresql_only = pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="PostgreSQL only: the timeline"
)


def floor_row() -> tuple[int, int | None] | None:
    with raw_postgres() as raw:
        found = raw.execute("SELECT token, timeline FROM distlock_floor WHERE id = 1").fetchone()
    return None if found is None else (int(found[0]), found[1])


def server_timeline() -> int:
    with raw_postgres() as raw:
        name = raw.execute("SELECT pg_walfile_name(pg_current_wal_insert_lsn())").fetchone()[0]
    return int(name[:8], 16)


def record(timeline: int | None) -> None:
    """Record ``timeline`` in the floor row (made if missing), as another server did."""
    with raw_postgres() as raw:
        raw.execute(
            "INSERT INTO distlock_floor (id, token, timeline) VALUES (1, 0, %s) "
            "ON CONFLICT (id) DO UPDATE SET timeline = EXCLUDED.timeline", [timeline],
        )


def new_session(alias: str = "default") -> None:
    """Close the alias's connection and open a new one (connection_created runs)."""
    connections[alias].close()
    connections[alias].ensure_connection()


def token(name: str) -> int:
    with raw_postgres() as raw:
        return int(raw.execute("SELECT token FROM distlock_lock WHERE name = %s",
                               [name]).fetchone()[0])


@pytest.fixture
def broken() -> Any:
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        seen.append(kwargs)

    lock_broken.connect(receiver)
    yield seen
    lock_broken.disconnect(receiver)


@postgresql_only
def test_a_new_timeline_raises_every_token_once_and_ends_every_lease(broken, caplog):
    held = acquire("follow:held", ttl=60)
    acquire("follow:free", ttl=60).release()
    before = token("follow:held")
    now = server_timeline()
    record(now - 1 if now > 1 else now + 1)
    with caplog.at_level(logging.WARNING, logger="distlock.ops.failover"):
        new_session()
    # Every token and the floor above the largest one plus the margin; the held lease
    # ended, its holder told through lock_broken; the server's timeline recorded.
    raised = before + DEFAULT_MARGIN
    assert token("follow:held") == token("follow:free") == raised
    assert floor_row() == (raised, now)
    assert held.is_current() is False
    assert [(b["name"], b["token"], b["by"]) for b in broken] == [
        ("follow:held", held.token, f"failover to timeline {now}")
    ]
    assert f"is on timeline {now}" in caplog.text
    # A new lease is above everything before; later sessions raise nothing more.
    assert acquire("follow:held", ttl=60).token == raised + 1
    for _ in range(3):
        new_session()
    assert floor_row() == (raised, now)
    assert token("follow:free") == raised
    assert len(broken) == 1


@postgresql_only
def test_sessions_that_start_together_on_a_new_timeline_raise_once(broken):
    acquire("follow:together", ttl=60)
    before = token("follow:together")
    now = server_timeline()
    record(now + 7)
    sessions = 4
    gate = threading.Barrier(sessions, timeout=30)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            gate.wait()
            connection.ensure_connection()  # this thread's own connection
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=start) for _ in range(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert token("follow:together") == before + DEFAULT_MARGIN
    assert floor_row() == (before + DEFAULT_MARGIN, now)
    assert len(broken) == 1


@postgresql_only
def test_the_same_timeline_changes_nothing(broken):
    lease = acquire("follow:same", ttl=60)
    new_session()
    assert floor_row() is not None and floor_row()[1] == server_timeline()  # type: ignore[index]
    new_session()
    assert token("follow:same") == lease.token and lease.is_current()
    assert broken == []


@postgresql_only
def test_no_timeline_recorded_is_recorded_without_a_raise(broken):
    lease = acquire("follow:first", ttl=60)
    record(None)
    new_session()
    assert floor_row() == (0, server_timeline())
    assert lease.is_current() and token("follow:first") == lease.token
    # A missing floor row (a flush) is put back and recorded the same way.
    with raw_postgres() as raw:
        raw.execute("DELETE FROM distlock_floor")
    new_session()
    assert floor_row() == (lease.token, server_timeline())
    assert lease.is_current() and broken == []


@postgresql_only
def test_a_raise_that_fails_leaves_no_session_and_changes_nothing(broken):
    # Tokens so high that the raise would pass 2**63 - 1: it raises TokenExhausted.
    from distlock import TokenExhausted
    from distlock.constants import MAX_TOKEN

    acquire("follow:top", ttl=60).release()
    with raw_postgres() as raw:
        raw.execute("UPDATE distlock_lock SET token = %s WHERE name = 'follow:top'",
                    [MAX_TOKEN - 10])
    record(0)
    connection.close()
    with pytest.raises(TokenExhausted):
        connection.ensure_connection()
    # The session that could not raise is closed, not handed to the next query.
    assert connection.connection is None
    assert floor_row() is not None and floor_row()[1] == 0  # type: ignore[index]
    assert token("follow:top") == MAX_TOKEN - 10 and broken == []
    with raw_postgres() as raw:  # the next session's follow can raise again
        raw.execute("UPDATE distlock_lock SET token = 5 WHERE name = 'follow:top'")
    new_session()
    assert floor_row() == (5 + DEFAULT_MARGIN, server_timeline())


@postgresql_only
def test_follow_off_leaves_a_new_timeline_alone(settings, broken):
    settings.DISTLOCK_FOLLOW_TIMELINE = False
    lease = acquire("follow:off", ttl=60)
    record(0)
    new_session()
    assert lease.is_current() and token("follow:off") == lease.token
    assert floor_row() == (0, 0)


@postgresql_only
def test_a_database_without_the_floor_table_is_skipped():
    # The maintenance database Django's test runner connects to, a database before
    # migrate: the check finds no table and does nothing (no error, no transaction left).
    from distlock.backends import pg_timeline

    with raw_postgres(dbname="postgres") as raw:
        assert pg_timeline.read(raw) is None
        assert raw.info.transaction_status == 0
        assert pg_timeline.follow(backend_for(connection), raw, 10) is None


@pytest.mark.skipif("connection.vendor == 'postgresql'", reason="SQLite and MariaDB")
def test_other_databases_have_no_timeline():
    lease = acquire("follow:elsewhere", ttl=60)
    new_session()
    assert backend_for(connection).follow_timeline(connection, DEFAULT_MARGIN) is None
    assert lease.is_current()
