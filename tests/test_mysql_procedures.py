"""MariaDB/MySQL: the stored procedures of the lock operations and the folded fenced check.

Acquire, renew and release are one ``CALL`` each (migration 0006): the connection must
stay usable for Django's own queries afterwards (mysqlclient needs a CALL's extra result
sets read), every procedure must read the clock after its wait for the lock row, a
lock-wait timeout inside a procedure must still mean busy with nothing left open, and
the fenced write's folded ownership check must lock the lock row (under
Django's READ COMMITTED a plain sub-select would read a snapshot and take no lock, so a
stale holder's write would land while a take-over is committing).
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from distlock import LockLost, StaleToken, acquire
from distlock.db import db_now_us
from distlock.models import Lock
from tests.factories import AccountFactory
from tests.support.helpers import wait_until
from tests.testapp.models import Account

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", "locks"]),
    pytest.mark.skipif(
        "connection.vendor != 'mysql'",
        reason="MariaDB/MySQL only: stored procedures and the LOCK IN SHARE MODE sub-select",
    ),
]

DEADLINE = 20.0


def in_transaction(alias: str = "default") -> bool:
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT @@in_transaction")
        return bool(cursor.fetchone()[0])


def test_each_call_leaves_the_connection_usable_and_no_transaction_open():
    """After every outcome of every procedure, Django's next queries run (no "commands
    out of sync") and the procedure's transaction is over."""
    account = AccountFactory()
    lease = acquire("calls", ttl=30)
    assert not in_transaction()
    assert Account.objects.get(pk=account.pk).pk == account.pk
    assert acquire("calls", ttl=30, blocking=False) is None  # busy
    assert Lock.objects.filter(name="calls").count() == 1
    lease.renew(ttl=30)
    assert Lock.objects.get(name="calls").renew_count == 1  # renewed
    assert not in_transaction()
    assert lease.release() is True
    assert lease.release() is False  # not held any more
    assert Lock.objects.get(name="calls").owner == ""
    assert not in_transaction()
    with pytest.raises(LockLost, match="released"):
        lease.renew(ttl=30)  # changed
    assert list(Account.objects.filter(pk=account.pk).values_list("pk", flat=True)) == [
        account.pk
    ]
    assert not in_transaction()


def test_a_call_is_one_statement_in_autocommit():
    with CaptureQueriesContext(connection) as captured:
        lease = acquire("one-call", ttl=30)
        lease.renew(ttl=30)
        lease.release()
    sql = [q["sql"] for q in captured]
    assert [s.split("(", 1)[0] for s in sql] == [
        "CALL distlock_acquire", "CALL distlock_renew", "CALL distlock_release"
    ], sql


def _hold_row(name: str, ready: threading.Event, done: threading.Event, errors: list) -> None:
    """Hold the lock row of ``name`` FOR UPDATE on a connection of its own until ``done``."""
    try:
        with connections["locks"].cursor() as cursor:
            cursor.execute("START TRANSACTION")
            cursor.execute(f"SELECT token FROM {Lock._meta.db_table} WHERE name = %s FOR UPDATE",
                           [name])
            ready.set()
            done.wait(DEADLINE)
            cursor.execute("ROLLBACK")
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)
        ready.set()
    finally:
        connections["locks"].close()


def test_lock_wait_timeout_inside_a_procedure_is_busy_and_rolled_back():
    """innodb_lock_wait_timeout ends the procedure's wait for the row (1205): the exit
    handler rolls back and RESIGNALs it with its code, so acquire says busy (None)."""
    acquire("waited", ttl=30).release()
    ready, done, errors = threading.Event(), threading.Event(), []
    holder = threading.Thread(target=_hold_row, args=("waited", ready, done, errors))
    holder.start()
    try:
        assert ready.wait(DEADLINE) and not errors, errors
        with connection.cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
        try:
            assert acquire("waited", ttl=30, blocking=False) is None
            assert not in_transaction()
            assert Lock.objects.get(name="waited").owner == ""
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")
    finally:
        done.set()
        holder.join(DEADLINE)
    assert not errors, errors
    lease = acquire("waited", ttl=30, blocking=False)
    assert lease is not None and lease.release() is True


def _running(name: str, deadline: float) -> bool:
    """True once another session runs a statement naming ``name`` (a CALL). INNODB_TRX
    did not list these waits reliably; the caller proves the wait by the statement not
    having finished a while later."""
    with connections["default"].cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                "WHERE ID <> CONNECTION_ID() AND INFO LIKE %s", [f"%{name}%"],
            )
            if cursor.fetchone()[0]:
                return True
            time.sleep(0.005)
    return False


@pytest.mark.parametrize("operation", ["acquire", "renew", "release"])
def test_the_clock_is_read_after_the_wait_for_the_lock_row(operation):
    """Another connection holds the lock row (FOR UPDATE) while a lease of 0.3 s runs
    out, and commits only after the database clock has passed its expiry. An operation
    that waited for the row meanwhile must judge and stamp with a clock read after the
    wait: the take-over is granted, starting after the commit; the renewal is refused
    (expired); the release says "not held", stamped after the commit. A clock read when
    the CALL arrived (NOW(), or SYSDATE() before the FOR UPDATE) would still see the
    lease live."""
    name = f"clock-after-lock:{operation}"
    lease = acquire(name, ttl=0.3)
    expires = Lock.objects.get(name=name).expires_us
    outcome: list[object] = []

    def operate() -> None:
        try:
            if operation == "acquire":
                outcome.append(acquire(name, ttl=30, blocking=False))
            elif operation == "renew":
                outcome.append(lease.renew(ttl=30))
            else:
                outcome.append(lease.release())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome.append(exc)
        finally:
            connections.close_all()

    blocker = connections["locks"]
    with blocker.cursor() as cursor:
        cursor.execute("START TRANSACTION")
        cursor.execute(f"SELECT token FROM {Lock._meta.db_table} WHERE name = %s FOR UPDATE",
                       [name])
        worker = threading.Thread(target=operate)
        worker.start()
        try:
            running = _running(name, time.monotonic() + DEADLINE)
            wait_until(lambda: db_now_us("locks") > expires, DEADLINE,
                       "the lease's expiry by the database clock")
            waited = running and not outcome  # still not done: it waits for the row
            committed_us = db_now_us("locks")
        finally:
            cursor.execute("COMMIT")
            worker.join(DEADLINE)
    blocker.close()
    assert waited, "the operation never waited for the row"
    assert len(outcome) == 1, outcome
    row = Lock.objects.get(name=name)
    if operation == "acquire":
        taker = outcome[0]
        assert taker is not None and not isinstance(taker, BaseException), outcome
        assert taker.token == lease.token + 1
        assert row.acquired_us >= committed_us, (row.acquired_us, committed_us)
    elif operation == "renew":
        assert isinstance(outcome[0], LockLost) and "expired" in str(outcome[0]), outcome
        assert row.expires_us == expires and row.renew_count == 0
    else:
        assert outcome[0] is False, outcome
        assert row.owner == "" and row.expires_us >= committed_us, (row.expires_us, committed_us)


def _statement_waits(cursor, owner: str, deadline: float) -> bool:
    """True once another session runs the fenced UPDATE of ``owner``'s lease and has not
    finished it. (MariaDB evaluates the uncorrelated sub-select while it optimizes the
    UPDATE, state "Statistics", so the wait does not show in INNODB_TRX.)"""
    while time.monotonic() < deadline:
        cursor.execute(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID() "
            "AND INFO LIKE %s AND INFO LIKE '%%LOCK IN SHARE MODE%%'", [f"%{owner}%"],
        )
        if cursor.fetchone()[0]:
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("form", ["fenced_update", "save"])
def test_folded_check_waits_for_a_take_over_and_refuses_the_stale_write(form):
    """A take-over holds the lock row (FOR UPDATE, token + 1, uncommitted) while the old
    holder writes with its still-unexpired lease: the write's folded check must wait for
    the row and, once the take-over commits, refuse the write. A check that did not lock
    the row would read the committed snapshot (lease current) and the write would land.
    """
    account = AccountFactory(balance=0)
    name = f"account:{account.pk}"
    lease = acquire(name, ttl=60)
    account.balance = 5

    def write() -> None:
        if form == "save":
            account.save(fence=lease)
        else:
            Account.objects.filter(pk=account.pk).fenced_update(
                lease, balance=F("balance") + 5
            )

    with CaptureQueriesContext(connection) as captured:
        write()  # folded: one statement, no transaction of its own
    assert len(captured) == 1 and "LOCK IN SHARE MODE" in captured[0]["sql"], captured
    outcome: list[BaseException | None] = []

    def stale_writer() -> None:
        try:
            write()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome.append(exc)
        finally:
            connections.close_all()

    taker = connections["locks"]
    with taker.cursor() as cursor:
        cursor.execute("START TRANSACTION")
        cursor.execute(f"SELECT token FROM {Lock._meta.db_table} WHERE name = %s FOR UPDATE",
                       [name])
        cursor.execute(
            f"UPDATE {Lock._meta.db_table} SET token = token + 1, owner = 'taker' "
            "WHERE name = %s", [name],
        )
        writer = threading.Thread(target=stale_writer)
        writer.start()
        try:
            waited = _statement_waits(cursor, lease.owner, time.monotonic() + DEADLINE)
            # Still not done a moment later: it waits for the row, not for the CPU.
            still = time.monotonic() + 0.3
            while time.monotonic() < still and not outcome:
                time.sleep(0.01)
            landed_early = bool(outcome)
        finally:
            cursor.execute("COMMIT")
            writer.join(DEADLINE)
    taker.close()
    assert waited and not landed_early, (waited, outcome)
    assert len(outcome) == 1 and isinstance(outcome[0], StaleToken), outcome
    row = Account.objects.get(pk=account.pk)
    assert (row.balance, row.fence_token) == (5, lease.token)
