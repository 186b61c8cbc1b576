"""MariaDB/MySQL: the stored procedures of the lock operations and the folded fenced check.

Acquire, renew and release are one ``CALL`` each (migration 0003): the connection must
stay usable for Django's own queries afterwards (mysqlclient needs a CALL's extra result
sets read), every procedure must read the clock after its wait for the lock row, a
lock-wait timeout inside a procedure must still mean busy with nothing left open, and
the fenced write's folded ownership check must lock the lock row (under
Django's READ COMMITTED a plain sub-select would read a snapshot and take no lock, so a
stale holder's write would land while a take-over is committing).
"""

from __future__ import annotations

import contextlib
import threading
import time
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import OperationalError, connection, connections, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from distlock import LockLost, StaleToken, TransactionNotAllowed, acquire
from distlock.backends import backend_for
from distlock.backends.results import Grant
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


def test_calls_back_to_back_read_all_their_result_sets():
    """distlock sends its CALLs on mysqlclient's connection, not through its cursor (whose
    next statement would first drain whatever was left): each CALL must read its own
    status result, or the very next CALL fails with "commands out of sync"."""
    lease = acquire("back-to-back", ttl=30)
    assert acquire("back-to-back", ttl=30, blocking=False) is None
    lease.renew(ttl=30)
    assert lease.release() is True
    again = acquire("back-to-back", ttl=30, blocking=False)
    assert again is not None and again.release() is True
    assert connection.connection.next_result() == -1, "a result set was left unread"


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


# -- set_autocommit(False): the CALL path and the caller's transaction -----------------------
#
# A procedure's START TRANSACTION would commit whatever the caller's connection has open, so
# a CALL must never be sent inside one. distlock's API refuses to run inside the caller's
# transaction on the lock's alias (TransactionNotAllowed, before any statement); on a
# separate lock alias the CALLs run on that connection, in autocommit, whatever the
# caller's does; and the backend, called inside a transaction (never by the API), runs the
# portable statements in it instead (docs/databases.md, "Stored procedures").


def _calls(captured: CaptureQueriesContext) -> list[str]:
    return [q["sql"].split("(", 1)[0] for q in captured if q["sql"].startswith("CALL")]


def test_autocommit_off_on_the_lock_alias_refuses_before_any_call():
    """Refused with nothing sent: the caller's own write stays uncommitted (its rollback
    undoes it) and the lease is as it was. After set_autocommit(True) the same connection
    and its kept lean cursor make the CALLs again."""
    lease = acquire("manual", ttl=30)
    before = Lock.objects.values().get(name="manual")
    transaction.set_autocommit(False)
    try:
        account = AccountFactory(note="caller's write")
        with CaptureQueriesContext(connection) as captured:
            with pytest.raises(TransactionNotAllowed, match="set_autocommit"):
                acquire("manual:new", ttl=30)
            with pytest.raises(TransactionNotAllowed, match="set_autocommit"):
                lease.renew(ttl=60)
            with pytest.raises(TransactionNotAllowed, match="set_autocommit"):
                lease.release()
        assert list(captured) == [], "a refused operation sent a statement"
        assert in_transaction(), "the caller's transaction was committed or ended"
        transaction.rollback()
    finally:
        transaction.set_autocommit(True)
    assert not Account.objects.filter(pk=account.pk).exists(), "the caller's write was committed"
    assert Lock.objects.values().get(name="manual") == before
    assert not Lock.objects.filter(name="manual:new").exists()
    lease.renew(ttl=30)  # through the lean cursor: nothing watches the queries
    assert Lock.objects.get(name="manual").renew_count == 1
    with CaptureQueriesContext(connection) as captured:
        assert lease.release() is True
    assert _calls(captured) == ["CALL distlock_release"]
    assert not in_transaction()
    assert Lock.objects.get(name="manual").owner == ""


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_autocommit_off_on_the_data_alias_calls_on_the_lock_alias_in_autocommit(settings, end):
    """DISTLOCK_DATABASE on a second alias: the caller's transaction on the first stays
    open and its own; each CALL runs on the lock alias with no transaction open there
    before or after, and commits on its own, whichever way the caller ends."""
    settings.DISTLOCK_DATABASE = "locks"
    locks = connections["locks"]
    locks.ensure_connection()
    assert not in_transaction("locks")
    transaction.set_autocommit(False)
    try:
        account = AccountFactory(note="caller's write")
        with CaptureQueriesContext(locks) as captured:
            lease = acquire("separate", ttl=30)
            assert not in_transaction("locks")
            granted = Lock.objects.using("locks").get(name="separate")
            assert (granted.owner, granted.token) == (lease.owner, lease.token)
            lease.renew(ttl=60)
            assert not in_transaction("locks")
            assert Lock.objects.using("locks").get(name="separate").renew_count == 1
            assert lease.release() is True
            assert not in_transaction("locks")
        assert _calls(captured) == [
            "CALL distlock_acquire", "CALL distlock_renew", "CALL distlock_release"
        ]
        assert in_transaction("default"), "the caller's transaction was committed"
        (transaction.commit if end == "commit" else transaction.rollback)()
    finally:
        transaction.set_autocommit(True)
    assert Account.objects.filter(pk=account.pk).exists() is (end == "commit")
    row = Lock.objects.get(name="separate")
    assert (row.token, row.owner, row.renew_count) == (lease.token, "", 1)
    # Both connections go on as before: a grant through the API on the lock alias.
    again = acquire("separate", ttl=30)
    assert again.token == lease.token + 1 and again.release() is True
    assert Account.objects.count() == (1 if end == "commit" else 0)


def test_the_backend_inside_a_transaction_runs_the_portable_steps_in_it():
    """Called with the caller's transaction open (the API never does), acquire, renew and
    release send no CALL: their statements join that transaction, so its rollback undoes
    a grant and its commit keeps it; the transaction stays open throughout."""
    acquire("inside", ttl=30).release()
    start = Lock.objects.get(name="inside").token
    backend = backend_for(connection)
    owner = "a" * 32
    transaction.set_autocommit(False)
    try:
        with CaptureQueriesContext(connection) as captured, connection.cursor() as cursor:
            grant = backend.acquire_existing(cursor, "inside", owner, "by hand", 30_000_000)
            assert isinstance(grant, Grant) and grant.token == start + 1
            assert in_transaction()
        sql = [q["sql"] for q in captured]
        assert _calls(captured) == [] and any("FOR UPDATE" in s for s in sql), sql
        transaction.rollback()
        assert Lock.objects.values_list("token", "owner").get(name="inside") == (start, "")

        with CaptureQueriesContext(connection) as captured, connection.cursor() as cursor:
            grant = backend.acquire_existing(cursor, "inside", owner, "by hand", 30_000_000)
            assert isinstance(grant, Grant) and grant.token == start + 1
            renewed = backend.renew(cursor, "inside", owner, grant.token, 60_000_000)
            assert isinstance(renewed, Grant) and renewed.token == grant.token
            assert in_transaction()
        transaction.commit()
        row = Lock.objects.get(name="inside")
        assert (row.token, row.owner, row.renew_count) == (grant.token, owner, 1)

        with connection.cursor() as cursor:
            held, released_us = backend.release(cursor, "inside", owner, grant.token)
            assert held is True and released_us is not None
        transaction.commit()
        assert _calls(captured) == []
    finally:
        transaction.set_autocommit(True)
    assert Lock.objects.values_list("token", "owner").get(name="inside") == (grant.token, "")
    # The CALL path is back on the same connection, through Django's cursor and the lean
    # one (used when nothing watches the queries).
    with CaptureQueriesContext(connection) as captured:
        lease = acquire("inside", ttl=30)
    assert _calls(captured) == ["CALL distlock_acquire"]
    assert lease.release() is True
    assert lease.token == grant.token + 1 and not in_transaction()
    assert Lock.objects.values_list("token", "owner").get(name="inside") == (lease.token, "")


# -- a missing procedure (migration 0003 not run, or its procedures dropped) -----------------


def test_a_missing_procedure_is_named_by_the_doctor_and_by_the_failing_call():
    """Without distlock_release (as after a mysqldump without --routines) distlock_doctor
    fails and says what to run, and the CALL's error 1305 says the same instead of only
    "PROCEDURE … does not exist"; the failed release changed nothing, can be tried again,
    and the connection stays usable. Put back, everything passes again."""
    lease = acquire("orphan", ttl=30)
    backend = backend_for(connection)
    assert backend.missing_procedures(connection) == []
    with connection.cursor() as cursor:
        cursor.execute("DROP PROCEDURE distlock_release")
    try:
        assert backend.missing_procedures(connection) == ["distlock_release"]
        out = StringIO()
        with pytest.raises(CommandError, match="1 problem"):
            call_command("distlock_doctor", stdout=out)
        report = out.getvalue()
        assert "[FAIL] stored procedure(s) distlock_release missing" in report
        assert "0003_mysql_procedures" in report and "manage.py migrate distlock" in report
        for use_lean_cursor in (True, False):
            with contextlib.ExitStack() as watching:
                if not use_lean_cursor:
                    watching.enter_context(CaptureQueriesContext(connection))
                with pytest.raises(OperationalError) as raised:
                    lease.release()
            error = raised.value
            assert error.args[0] == 1305, error.args
            assert "distlock's stored procedure distlock_release does not exist" in str(error)
            assert "manage.py migrate distlock" in str(error) and "--routines" in str(error)
            assert "does not exist" in str(error.__cause__)  # MariaDB's own message
        assert not in_transaction()
        assert Lock.objects.get(name="orphan").owner == lease.owner
    finally:
        with connection.schema_editor(atomic=False) as editor:
            backend.install_procedures(editor, True)
    assert backend.missing_procedures(connection) == []
    assert "no problems" in _doctor()
    assert lease.release() is True
    assert Lock.objects.get(name="orphan").owner == ""


def _doctor() -> str:
    out = StringIO()
    call_command("distlock_doctor", stdout=out)
    return out.getvalue()
