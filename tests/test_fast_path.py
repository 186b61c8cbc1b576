"""The short acquire path: one statement per operation on PostgreSQL, kept connections.

Issue 7 moved PostgreSQL's acquire, renew and release into server-side functions
(migration 0002) run in autocommit mode. These tests pin what that must not change:
the same results and reasons as the Python path, FOR UPDATE semantics for grants, a
refusal that takes no row lock, Django's query instrumentation still seeing the
statements, and connections that are reused, or replaced once broken.
"""

from __future__ import annotations

import enum
import select
import signal
import threading
import time

import pytest
from django.db import DatabaseError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils.safestring import mark_safe

from distlock import LockLost, acquire, break_lock
from distlock.backends import backend_for
from distlock.backends.lean_cursor import LeanCursor, LoggedCursor
from distlock.backends.pg_wire import WireCursor
from distlock.backends.postgresql import _BoundCursor
from distlock.conf import conf
from distlock.models import Lock, TokenFloor
from tests.support.helpers import wait_expired, wait_until

pytestmark = pytest.mark.usefixtures("lock_db")

postgresql_only = pytest.mark.skipif(
    "connection.vendor != 'postgresql'",
    reason="PostgreSQL's path: server-side functions, prepared statements",
)


def _raw_postgresql():
    """A second session outside Django, to look at or lock rows behind distlock's back."""
    import psycopg

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**params, autocommit=True)


@postgresql_only
def test_each_operation_is_one_statement_of_its_server_function():
    with CaptureQueriesContext(connection) as queries:
        lease = acquire("one-statement", ttl=30, blocking=False)
        lease.renew()
        assert lease.release() is True
    sql = [q["sql"] for q in queries.captured_queries]
    assert len(sql) == 3, sql
    for statement, function in zip(sql, ["acquire", "renew", "release"], strict=True):
        assert f"distlock_{function}(" in statement


@postgresql_only
def test_execute_wrappers_see_the_lock_statements():
    seen: list[str] = []

    def wrapper(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper):
        acquire("wrapped", ttl=30).release()
    assert [s.split("FROM ")[1].split("(")[0] for s in seen] == [
        "distlock_acquire", "distlock_release"
    ]


@postgresql_only
def test_the_lean_cursor_is_used_unless_an_execute_wrapper_watches():
    connection.ensure_connection()
    backend = backend_for(connection)
    # The wire cursor prepares; with DISTLOCK_PREPARE_STATEMENTS off (an old pooler's
    # setting) the lean cursor is psycopg's, which follows the connection's threshold.
    lean = WireCursor if conf.PREPARE_STATEMENTS else _BoundCursor
    assert type(backend.statement_cursor(connection)) is lean
    # The debug query log gets the lean cursor, logging (tests/test_query_log.py).
    with CaptureQueriesContext(connection):
        cursor = backend.statement_cursor(connection)
        assert type(cursor) is LoggedCursor and type(cursor.lean) is lean
    with connection.execute_wrapper(lambda execute, *args: execute(*args)):
        assert not isinstance(backend.statement_cursor(connection), LeanCursor | LoggedCursor)


@postgresql_only
def test_grant_results_match_the_row_and_tokens_start_above_the_floor():
    acquire("high", ttl=30).release()
    TokenFloor.objects.update_or_create(id=1, defaults={"token": 1000})
    lease = acquire("fresh-name", ttl=30)
    row = Lock.objects.get(name="fresh-name")
    assert lease.token == row.token == 1001
    assert (row.owner, row.expires_at, row.acquired_at) == (
        lease.owner, lease.expires_at, lease.acquired_at
    )
    assert lease.release() is True
    assert Lock.objects.get(name="fresh-name").is_free


@postgresql_only
def test_a_refused_try_takes_no_row_lock_and_does_not_queue():
    holder = acquire("busy", ttl=60)
    raw = _raw_postgresql()
    try:
        # Another transaction holds the row lock of the busy lock (as a fenced write's
        # FOR SHARE or an acquire in flight would). A try must still answer at once.
        raw.execute("BEGIN")
        raw.execute("SELECT 1 FROM distlock_lock WHERE name = 'busy' FOR UPDATE")
        started = time.monotonic()
        assert acquire("busy", ttl=5, blocking=False) is None
        assert time.monotonic() - started < 10
        raw.execute("ROLLBACK")
        # xmax stays 0: nobody locked or changed the row version the grant wrote.
        xmax_before = raw.execute(
            "SELECT xmax::text FROM distlock_lock WHERE name = 'busy'"
        ).fetchone()[0]
        assert acquire("busy", ttl=5, blocking=False) is None
        xmax_after = raw.execute(
            "SELECT xmax::text FROM distlock_lock WHERE name = 'busy'"
        ).fetchone()[0]
        assert xmax_before == xmax_after
    finally:
        raw.close()
    assert holder.release() is True


@postgresql_only
@pytest.mark.no_pooler("a reservation names a server session: behind a pooler the try may run "
                       "on the very session that reserved it")
def test_a_try_on_a_lock_reserved_for_another_session_takes_no_row_lock():
    # distlock_acquire locks a row at once only if it looks free; a free row reserved for
    # another waiter (the hand-off's grant window) does not look free to anyone else.
    acquire("reserved", ttl=30).release()
    raw = _raw_postgresql()
    try:
        raw.execute(
            "UPDATE distlock_lock SET reserved_pid = pg_backend_pid(), reserved_until_us = "
            "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT) + 3600000000 "
            "WHERE name = 'reserved'"
        )
        xmax_before = raw.execute(
            "SELECT xmax::text FROM distlock_lock WHERE name = 'reserved'"
        ).fetchone()[0]
        assert acquire("reserved", ttl=5, blocking=False) is None
        xmax_after = raw.execute(
            "SELECT xmax::text FROM distlock_lock WHERE name = 'reserved'"
        ).fetchone()[0]
        assert xmax_before == xmax_after
        # The window over, the same try is granted.
        raw.execute("UPDATE distlock_lock SET reserved_until_us = 1 WHERE name = 'reserved'")
        lease = acquire("reserved", ttl=5, blocking=False)
        assert lease is not None and lease.release() is True
    finally:
        raw.close()


@postgresql_only
def test_a_grant_waits_for_the_row_lock_then_judges_by_the_clock_after_it():
    first = acquire("queued", ttl=30)
    assert first.release() is True
    raw, watcher = _raw_postgresql(), _raw_postgresql()
    try:
        # Hold the free row's lock, then make the row look held for an hour by the
        # database clock: the waiting grant must judge that version, not the free one.
        raw.execute("BEGIN")
        raw.execute("SELECT 1 FROM distlock_lock WHERE name = 'queued' FOR UPDATE")
        result: list[object] = []
        waiter = threading.Thread(
            target=lambda: (result.append(acquire("queued", ttl=30, blocking=False)),
                            connections.close_all()),
        )
        waiter.start()
        deadline = time.monotonic() + 30
        # (Watched from another session: inside raw's transaction, pg_stat_activity
        # would stay the snapshot of its first read.)
        while not watcher.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND query LIKE '%%distlock_acquire%%'"
        ).fetchone()[0]:
            assert time.monotonic() < deadline, "the grant never waited for the row lock"
            time.sleep(0.01)
        raw.execute(
            "UPDATE distlock_lock SET owner = repeat('a', 32), holder = 'other', "
            "expires_us = CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"
            " + 3600000000 WHERE name = 'queued'"
        )
        raw.execute("COMMIT")
        waiter.join(timeout=30)
        assert result == [None]
    finally:
        raw.close()
        watcher.close()
    row = Lock.objects.get(name="queued")
    assert (row.token, row.holder) == (first.token, "other")


@postgresql_only
def test_renew_refusals_keep_their_reasons():
    lease = acquire("renew-reasons", ttl=0.2)
    wait_expired("renew-reasons", timeout=30.0)
    with pytest.raises(LockLost, match="expired before the renewal"):
        lease.renew()
    other = acquire("renew-reasons", ttl=30)
    assert break_lock("renew-reasons")
    with pytest.raises(LockLost, match="released, broken or taken over"):
        other.renew()


def _prepared_acquires() -> int:
    """How many statements calling distlock_acquire this session has prepared."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s",
            ["%distlock_acquire(%"],
        )
        return cursor.fetchone()[0]


@postgresql_only
@pytest.mark.no_pooler("counts the statements prepared on its own session")
def test_statements_are_prepared_once_per_session():
    """DISTLOCK_PREPARE_STATEMENTS (default True): prepared at first use, then reused."""
    connection.close()
    acquire("prepared", ttl=30, blocking=False).release()
    assert _prepared_acquires() == 1
    for _ in range(3):
        acquire("prepared", ttl=30, blocking=False).release()
    assert _prepared_acquires() == 1


@postgresql_only
@pytest.mark.no_pooler("counts the statements prepared on its own session")
def test_statements_follow_the_connection_when_told_not_to_prepare(settings):
    """DISTLOCK_PREPARE_STATEMENTS = False (a PgBouncer without prepared statements):
    like Django's own queries, prepared only if OPTIONS["prepare_threshold"] says so."""
    settings.DISTLOCK_PREPARE_STATEMENTS = False
    connection.close()
    for _ in range(3):
        acquire("prepared", ttl=30, blocking=False).release()
    assert connection.connection.prepare_threshold is None
    assert _prepared_acquires() == 0
    connection.connection.prepare_threshold = 0  # what OPTIONS {"prepare_threshold": 0} sets
    try:
        for _ in range(2):
            acquire("prepared", ttl=30, blocking=False).release()
        assert _prepared_acquires() == 1
    finally:
        connection.connection.prepare_threshold = None


@postgresql_only
@pytest.mark.no_pooler("counts the statements prepared on its own session")
def test_a_session_that_lost_its_prepared_statements_prepares_them_again():
    """DEALLOCATE ALL behind psycopg's back (psycopg still thinks they exist): the next
    operation is not refused for it, nor is any later one on that connection."""
    connection.close()
    acquire("prepared", ttl=30, blocking=False).release()
    raw = connection.connection
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    assert _prepared_acquires() == 0
    for _ in range(2):
        lease = acquire("prepared", ttl=30, blocking=False)
        assert lease is not None
        assert lease.release()
    assert connection.connection is raw
    assert _prepared_acquires() == 1


@postgresql_only
def test_preparing_leaves_djangos_own_queries_unprepared():
    """Django's queries on the same connection stay as Django's default makes them."""
    connection.close()
    acquire("prepared", ttl=30, blocking=False).release()
    assert connection.connection.prepare_threshold is None
    for _ in range(10):
        Lock.objects.filter(name="prepared").update(holder="x")
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement NOT LIKE %s",
                       ["%distlock_%"])
        assert cursor.fetchone()[0] == 0


def test_operations_reuse_one_connection():
    """CONN_MAX_AGE = 0 (Django's default) must not mean a new connection per operation."""
    assert connection.settings_dict["CONN_MAX_AGE"] == 0
    acquire("reuse", ttl=30).release()
    raw = connection.connection
    for _ in range(3):
        lease = acquire("reuse", ttl=30)
        lease.renew()
        lease.release()
    assert connection.connection is raw


@postgresql_only
@pytest.mark.no_pooler("ends its session's backend: the pooler hides that from the client")
def test_a_broken_connection_fails_the_call_and_is_replaced_by_the_next():
    acquire("reconnect", ttl=30).release()
    pid = connection.connection.info.backend_pid
    raw = _raw_postgresql()
    try:
        raw.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 30
        while raw.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        raw.close()
    with pytest.raises(DatabaseError):
        acquire("reconnect", ttl=30, blocking=False)
    # The failed call granted nothing, and the next call runs on a new connection.
    lease = acquire("reconnect", ttl=30, blocking=False)
    assert lease is not None and connection.connection.info.backend_pid != pid
    assert Lock.objects.get(name="reconnect").owner == lease.owner
    assert lease.release() is True


@postgresql_only
def test_a_release_commits_without_waiting_for_its_flush_unless_told(settings):
    """DISTLOCK_DURABLE_RELEASE (default False): the release's own transaction runs with
    synchronous_commit = off; grants stay durable. True: the release waits too."""

    def durable_flag() -> str:
        """The p_durable argument of the release statement, as sent."""
        lease = acquire("durable", ttl=30)
        with CaptureQueriesContext(connection) as captured:
            assert lease.release() is True
        (statement,) = captured.captured_queries
        assert "distlock_release(" in statement["sql"]
        return statement["sql"].rstrip(")").rsplit(",", 1)[1].strip()

    assert durable_flag() == "false"
    settings.DISTLOCK_DURABLE_RELEASE = True
    assert durable_flag() == "true"
    # What the function does with it, as the database reports it.
    with connection.cursor() as cursor:
        for flag in (False, True):
            lease = acquire("durable", ttl=30)
            cursor.execute(
                "SELECT held, durable FROM distlock_release(%s, %s, %s, %s)",
                [lease.name, lease.owner, lease.token, flag],
            )
            assert cursor.fetchone() == (True, flag)
        cursor.execute("SHOW synchronous_commit")
        assert cursor.fetchone()[0] != "off"  # the session's setting is left alone


@postgresql_only
@pytest.mark.no_pooler("holds a row lock in its own transaction while a child waits")
@pytest.mark.processes
def test_ctrl_c_stops_a_lock_statement_that_waits_for_the_row(children):
    """The wire cursor waits for its result as psycopg does, so SIGINT (Ctrl-C) reaches a
    process whose acquire waits for a lock row another transaction holds: the statement
    is cancelled on the server and the process ends, long before the row is let go. (A
    blocking libpq call would hold both until the other transaction ended.)"""
    acquire("interrupted", ttl=30).release()
    waiter = children.start("wait_for", "interrupted", 30.0, 60.0)
    pid = waiter.expect("ready", timeout=60)["backend_pid"]

    def waits_for_the_row() -> bool:
        with connection.cursor() as cursor:
            # Read inside a transaction: without this, its first snapshot of the other
            # sessions' state and query is read again each time.
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND wait_event_type = "
                "'Lock' AND query LIKE %s", [pid, "%distlock_acquire(%"],
            )
            return bool(cursor.fetchone()[0])

    with transaction.atomic():
        Lock.objects.select_for_update().get(name="interrupted")
        waiter.send("go")
        wait_until(waits_for_the_row, timeout=30, what="the child waiting for the lock row")
        waiter.signal(signal.SIGINT)
        assert waiter.proc.wait(timeout=15) == 1
        ended = waiter.events.get(timeout=30)
        assert ended is not None and "KeyboardInterrupt" in ended["error"]
        wait_until(lambda: not waits_for_the_row(), timeout=30,
                   what="the cancelled statement to stop waiting")
        assert not Lock.objects.get(name="interrupted").owner


@postgresql_only
@pytest.mark.no_pooler("LISTENs on its own session")
def test_a_notification_read_during_a_lock_statement_is_not_lost():
    """A NOTIFY that reaches the session while distlock's statement runs is read from the
    socket by that statement: it must still come out of ``notifies()`` afterwards, as it
    would after any psycopg query."""
    connection.ensure_connection()
    raw = connection.connection
    with connection.cursor() as cursor:
        cursor.execute("LISTEN distlock_test_wire")
    try:
        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                cursor.execute("NOTIFY distlock_test_wire, 'hello'")
        finally:
            other.close()
        # Waits until the notification is in the socket, before distlock reads it.
        assert select.select([raw.pgconn.socket], [], [], 30)[0], "no notification came"
        lease = acquire("notified", ttl=30, blocking=False)
        assert lease is not None and lease.release()
        got = [n.payload for n in raw.notifies(timeout=5, stop_after=1)]
        assert got == ["hello"]
    finally:
        with connection.cursor() as cursor:
            cursor.execute("UNLISTEN distlock_test_wire")


class Big(enum.IntEnum):
    ONE = 1


@postgresql_only
@pytest.mark.no_pooler("prepares statements on its own session")
def test_the_wire_cursor_refuses_a_parameter_it_cannot_send(settings):
    """Only str, int, bool and None go out (distlock sends no others): anything else is a
    TypeError before a byte is sent, and the cursor still works after it."""
    settings.DISTLOCK_PREPARE_STATEMENTS = True
    connection.ensure_connection()
    cursor = backend_for(connection).statement_cursor(connection)
    assert isinstance(cursor, WireCursor)
    with pytest.raises(TypeError, match="cannot send a float"):
        cursor.execute("SELECT %s::text", [1.5])
    cursor.execute("SELECT %s::bigint, %s, %s::boolean, %s::text", [2**62, "é ☃", True, None])
    assert cursor.fetchone() == (2**62, "é ☃", True, None)
    # Subclasses go as their base type: a name may be Django's SafeString.
    cursor.execute("SELECT %s::text, %s::bigint, %s::boolean", [mark_safe("safe"), Big.ONE, False])
    assert cursor.fetchone() == ("safe", 1, False)


@postgresql_only
@pytest.mark.no_pooler("a SET on the session must stay on it")
def test_the_wire_cursor_follows_a_client_encoding_set_on_the_session(settings):
    """Code that runs ``SET client_encoding`` on Django's connection: the lock's name must
    still reach the server as the same characters, or one name would be two locks."""
    settings.DISTLOCK_PREPARE_STATEMENTS = True
    name = "café-ü"
    acquire(name, ttl=30).release()  # statements prepared and read in UTF-8 first
    with connection.cursor() as cursor:
        cursor.execute("SET client_encoding TO 'LATIN1'")
    try:
        lease = acquire(name, ttl=30, holder="holder é")
        assert isinstance(backend_for(connection).statement_cursor(connection), WireCursor)
        assert lease.holder.endswith(" holder é")
        assert list(Lock.objects.values_list("name", "holder", "token")) == [
            (name, lease.holder, lease.token)
        ]
        assert lease.token == 2
        lease.release()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET client_encoding TO 'UTF8'")
    assert acquire(name, ttl=30).token == 3


@postgresql_only
@pytest.mark.no_pooler("a SET on the session must stay on it")
@pytest.mark.parametrize("encoding", ["LATIN1", "WIN1252"])
def test_the_wire_cursor_reads_holders_in_a_client_encoding_set_on_the_session(
    settings, encoding
):
    """The read side of the test above: the acquire statement returns a holder (the expired
    lease's one a take-over names, the current one a refusal names), and after ``SET
    client_encoding`` the server sends it in the new encoding. psycopg's text loaders
    decode in the encoding they were made in, so loaders made while the session spoke
    UTF-8 would misread it (or fail on it): the holder must come back as written."""
    from distlock import lock_status, signals
    from distlock.core.grants import Request, try_once

    settings.DISTLOCK_PREPARE_STATEMENTS = True
    name = "holders:é"
    # The acquire statement prepared, and its columns read, in UTF-8 first.
    acquire(name, ttl=30).release()
    expired_holders: list[str] = []

    def record(sender, lease, took_over, **kwargs):
        expired_holders.append(took_over)

    with connection.cursor() as cursor:
        cursor.execute(f"SET client_encoding TO '{encoding}'")
    signals.lock_acquired.connect(record, weak=False)
    try:
        stale = acquire(name, ttl=0.05, holder="alte Inhaberin é ü")
        wait_expired(name)
        newer = acquire(name, ttl=30, holder="neuer Inhaber ü é")
        assert isinstance(backend_for(connection).statement_cursor(connection), WireCursor)
        # The take-over read the expired lease's holder back.
        assert expired_holders[-1] == stale.holder
        # A refusal reads the current holder.
        refused = try_once(Request(name, 30, False, None, None, ""))
        assert getattr(refused, "holder", None) == newer.holder
        assert lock_status(name).holder == newer.holder
        assert newer.release() is True
    finally:
        signals.lock_acquired.disconnect(record)
        with connection.cursor() as cursor:
            cursor.execute("SET client_encoding TO 'UTF8'")
