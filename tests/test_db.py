"""distlock/db.py's runner: an operation cut short by an exception from outside the database.

A KeyboardInterrupt, a Celery soft time limit (SoftTimeLimitExceeded, raised by a signal
handler) or anything else that is not the database's error can land in the middle of a
lock operation: with a statement's answer unread, a transaction begun and not ended, or a
statement still running on the server. ``db.run_on`` then calls
``Backend.interrupted``, which closes the connection unless the driver shows nothing was
left (PostgreSQL after Ctrl-C, which psycopg cancels and reads to its end). Each test
makes the exception land at one such moment — from a cursor hook or a signal handler
whose moment a condition picks, never a timer — and checks that the session is gone or
whole, and that no database lock of it is left for other sessions to wait on.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
from billiard.exceptions import SoftTimeLimitExceeded
from django.db import connection, connections

from distlock import acquire, break_lock
from distlock.backends.sqlite import _QmarkCursor
from distlock.models import Lock
from tests.support.helpers import RowHolder, lock_waits, raise_in_main_thread, wait_until

pytestmark = pytest.mark.usefixtures("lock_db")


def only(vendor: str, why: str) -> None:
    if connection.vendor != vendor:
        pytest.skip(f"{vendor} only: {why}")


def session_id() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT CONNECTION_ID()" if connection.vendor == "mysql" else "SELECT pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


def session_alive(session: int) -> bool:
    """Is server session ``session`` still there (asked on a connection of its own)?"""
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute("SELECT COUNT(*) FROM information_schema.processlist WHERE id = %s",
                           [session])
        else:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [session])
        return bool(cursor.fetchone()[0])


def assert_write_lock_free() -> None:
    """SQLite: another connection gets the file's write lock at once (no busy wait)."""
    other = sqlite3.connect(connections["default"].settings_dict["NAME"], timeout=0,
                            isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # "database is locked" if a write lock is left
        other.execute("ROLLBACK")
    finally:
        other.close()


def fresh(name: str) -> Lock:
    """Lock ``name``'s row, made and freed: the next acquire is the one-statement update."""
    acquire(name, ttl=30).release()
    return Lock.objects.get(name=name)


@pytest.fixture
def interrupt_after() -> Iterator[Any]:
    """``interrupt_after(start)``: from now on, the first statement of this thread's
    connection that starts with ``start`` runs, and then SoftTimeLimitExceeded is raised
    before Django or distlock sees its outcome."""
    hooked: list[Any] = []

    def install(start: str) -> None:
        def hook(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            result = execute(sql, params, many, context)
            if sql.startswith(start) and not fired:
                fired.append(sql)
                raise SoftTimeLimitExceeded()
            return result

        fired: list[str] = []
        connection.execute_wrappers.append(hook)
        hooked.append(hook)

    yield install
    for hook in hooked:
        if hook in connection.execute_wrappers:
            connection.execute_wrappers.remove(hook)


def test_sqlite_an_interrupt_inside_atomic_after_its_begin_closes_the_connection(
    interrupt_after,
):
    """Inside Django's atomic(), between its BEGIN IMMEDIATE and the point where it would
    roll back (its __exit__ never runs: the exception comes from its __enter__): the
    transaction holds the file's one write lock. The connection is closed, which ends it,
    and the next operation works."""
    only("sqlite", "its transactions begin with a statement a cursor hook sees")
    lease = acquire("interrupt:atomic", ttl=30)
    interrupt_after("BEGIN")
    # break_lock is not one of SQLite's one-statement operations: it runs in atomic().
    with pytest.raises(SoftTimeLimitExceeded):
        break_lock("interrupt:atomic")
    connection.execute_wrappers.clear()
    assert connection.connection is None, "the interrupted connection was kept"
    assert_write_lock_free()
    # The interrupted break wrote nothing; the next one's BEGIN works on a new connection.
    assert Lock.objects.get(name="interrupt:atomic").token == lease.token
    assert break_lock("interrupt:atomic")
    assert Lock.objects.get(name="interrupt:atomic").is_free


def test_sqlite_an_interrupt_before_an_update_returning_is_read_closes_the_connection(
    monkeypatch,
):
    """The lean cursor's ``UPDATE … RETURNING`` has run and its row is not read yet: the
    statement stays open and keeps the file's write lock (every other process waited its
    busy timeout out, found by tests/test_waiting_model.py). Closing ends it."""
    only("sqlite", "its lean cursor keeps an unread statement open")
    token = fresh("interrupt:unread").token

    def interrupted(self: Any) -> Any:
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(_QmarkCursor, "fetchone", interrupted)
    with pytest.raises(SoftTimeLimitExceeded):
        acquire("interrupt:unread", ttl=30, timeout=0)
    monkeypatch.undo()
    assert connection.connection is None, "the interrupted connection was kept"
    assert_write_lock_free()
    # The update ran before the interrupt: its lease is there, by nobody's knowledge.
    after = acquire("interrupt:unread", ttl=30, timeout=0)
    assert after is None or after.token > token


def test_mariadb_an_interrupt_between_a_call_and_its_results_closes_the_connection():
    """Between the CALL and the reading of its result sets: left unread, they make every
    later statement fail with "commands out of sync" (2014). The connection is closed (the
    server's session ends) and the next operation runs on a new one."""
    only("mysql", "its CALL cursor reads the result sets itself")
    token = fresh("interrupt:call").token
    before = session_id()
    def interrupted() -> None:
        raise SoftTimeLimitExceeded()

    # Not undone: this session is closed (and its object dropped) by what is tested.
    connection.connection.store_result = interrupted
    with pytest.raises(SoftTimeLimitExceeded):
        acquire("interrupt:call", ttl=30, timeout=0)
    assert connection.connection is None, "the interrupted connection was kept"
    wait_until(lambda: not session_alive(before), what="the interrupted session to end")
    with connection.cursor() as cursor:
        # Nobody holds the lock row: a locking read gets it at once.
        cursor.execute("SELECT token FROM distlock_lock WHERE name = %s FOR UPDATE NOWAIT",
                       ["interrupt:call"])
        assert cursor.fetchone() is not None
    # The CALL ran before the interrupt: its lease is there, by nobody's knowledge, and the
    # next CALL (no "commands out of sync") is refused by it.
    assert acquire("interrupt:call", ttl=30, timeout=0) is None
    assert Lock.objects.get(name="interrupt:call").token == token + 1


def test_postgresql_a_soft_time_limit_in_a_waiting_statement_cancels_it_and_closes(settings):
    """A soft time limit lands while the acquire's statement waits for the lock row:
    psycopg leaves the statement running (it cancels only on Ctrl-C). It is cancelled and
    the connection closed — the server's session ends while the row is still held,
    instead of waiting on and then granting the lock to nobody."""
    only("postgresql", "psycopg's statement waits where a signal reaches it")
    fresh("interrupt:waiting")
    before = session_id()
    with RowHolder("interrupt:waiting") as holder:
        with (
            raise_in_main_thread(SoftTimeLimitExceeded, when=lambda: lock_waits() >= 1),
            pytest.raises(SoftTimeLimitExceeded),
        ):
            acquire("interrupt:waiting", ttl=30, timeout=0)
        assert connection.connection is None, "the interrupted connection was kept"
        wait_until(lambda: not session_alive(before), what="the interrupted session to end")
        assert lock_waits() == 0
        holder.let_go()
    assert Lock.objects.get(name="interrupt:waiting").is_free, "granted to nobody"


def test_postgresql_ctrl_c_in_a_waiting_statement_keeps_the_session_whole():
    """Ctrl-C in the same wait: psycopg cancels the statement and reads its end, so the
    session is idle, and it is kept with the caller's own settings."""
    only("postgresql", "psycopg cancels a statement on KeyboardInterrupt")
    fresh("interrupt:ctrl-c")
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '25s'")
    before = session_id()
    with RowHolder("interrupt:ctrl-c"):
        with (
            raise_in_main_thread(KeyboardInterrupt, when=lambda: lock_waits() >= 1),
            pytest.raises(KeyboardInterrupt),
        ):
            acquire("interrupt:ctrl-c", ttl=30, timeout=0)
        assert connection.connection is not None, "an idle session was closed"
        assert session_id() == before
        with connection.cursor() as cursor:
            cursor.execute("SHOW lock_timeout")
            assert cursor.fetchone()[0] == "25s"
        assert lock_waits() == 0, "the cancelled statement still waits"
    assert Lock.objects.get(name="interrupt:ctrl-c").is_free
