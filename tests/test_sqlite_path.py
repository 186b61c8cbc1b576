"""SQLite's lock path: one autocommit statement per operation, BEGIN IMMEDIATE fallbacks.

distlock/backends/sqlite.py runs a grant of a free row, a renewal and a release as one
``UPDATE … RETURNING`` each, through the raw sqlite3 cursor when nothing watches the
connection's queries, and the rest (a take-over, a refusal's reason, SQLite < 3.35) in a
``BEGIN IMMEDIATE`` transaction of its own instead of Django's atomic(). These tests pin
what that must keep: the statements (under CaptureQueriesContext, as on PostgreSQL), the
clock read after the write lock with a real second process holding it, the busy timeout,
the refusals inside the caller's transaction, the fenced write's ownership check folded
into its UPDATE, and the same answers from the fallback as from the one statement.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import OperationalError, connection, connections, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from distlock import StaleToken, TransactionNotAllowed, acquire, purge_locks, signals
from distlock.backends import backend_for
from distlock.backends.lean_cursor import LeanCursor
from distlock.constants import PURGE_BUSY_RETRIES
from distlock.models import Lock, LockEvent, TokenFloor
from distlock.ops.audit import purge_events
from distlock.testing import make_stale
from tests.stressapp.models import Resource
from tests.support.helpers import expired_lock, wait_until

pytestmark = [
    pytest.mark.usefixtures("lock_db"),
    pytest.mark.skipif(
        "connections['default'].vendor != 'sqlite'",
        reason="SQLite's own lock path (distlock/backends/sqlite.py)",
    ),
]

# A second process that takes the file's write lock (BEGIN IMMEDIATE), says so, and when
# told to runs the statement it was given (if any) in that transaction, reads the database
# clock as distlock does, and commits.
_HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=30, isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("held", flush=True)
sys.stdin.readline()
if len(sys.argv) > 3:
    conn.execute(sys.argv[3])
now = conn.execute("SELECT " + sys.argv[2]).fetchone()[0]
conn.execute("COMMIT")
print(now, flush=True)
"""


class WriteLockHolder:
    """A real second process holding the SQLite file's write lock until commit()."""

    def __init__(self, *sql: str) -> None:
        path = connection.settings_dict["NAME"]
        now_sql = backend_for(connection).now_sql()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, path, now_sql, *sql],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        assert self.proc.stdout.readline().strip() == "held"

    def commit(self) -> int:
        """Commit; returns the database clock the holder read just before (epoch µs)."""
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        released_us = int(self.proc.stdout.readline())
        assert self.proc.wait(30) == 0
        return released_us

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def holder() -> Iterator[Any]:
    started: list[WriteLockHolder] = []

    def start(*sql: str) -> WriteLockHolder:
        started.append(WriteLockHolder(*sql))
        return started[-1]

    yield start
    for proc in started:
        proc.kill()


@pytest.fixture
def old_sqlite(monkeypatch: pytest.MonkeyPatch) -> None:
    """distlock as it runs on SQLite < 3.35 (no UPDATE … RETURNING): every operation in
    its BEGIN IMMEDIATE fallback."""
    monkeypatch.setattr(backend_for(connections["default"]), "has_update_returning", False)


def _sql(captured: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in captured.captured_queries]


def test_grant_renew_release_are_one_statement_each_and_logged():
    """The statements show up under CaptureQueriesContext (Django's cursor is used when
    queries are watched), and each common operation is one of them."""
    acquire("one", ttl=30).release()  # the row exists and is free
    with CaptureQueriesContext(connection) as captured:
        lease = acquire("one", ttl=30)
    assert len(_sql(captured)) == 1, _sql(captured)
    (grant,) = _sql(captured)
    assert grant.startswith("UPDATE distlock_lock SET token = token + 1") and "RETURNING" in grant
    with CaptureQueriesContext(connection) as captured:
        lease.renew(ttl=60)
    (renewal,) = _sql(captured)
    assert renewal.startswith("UPDATE") and "renew_count = renew_count + 1" in renewal
    with CaptureQueriesContext(connection) as captured:
        assert lease.release() is True
    (release,) = _sql(captured)
    assert release.startswith("UPDATE") and "owner = ''" in release
    with CaptureQueriesContext(connection) as captured:
        first = acquire("one:new", ttl=30)
    # A first use: the grant finds no row, the read says so, the INSERT creates it.
    grant, peek, create = _sql(captured)
    assert grant.startswith("UPDATE") and peek.startswith("SELECT")
    assert create.startswith("INSERT INTO distlock_lock") and "distlock_floor" in create
    first.release()


def test_the_lean_cursor_is_used_only_when_nobody_watches():
    backend = backend_for(connection)
    acquire("lean", ttl=30).release()
    assert not connection.queries_logged
    lean = backend.statement_cursor(connection)
    assert isinstance(lean, LeanCursor)
    assert backend.statement_cursor(connection) is lean, "one per database session"
    with CaptureQueriesContext(connection):
        assert not isinstance(backend.statement_cursor(connection), LeanCursor)
    with connection.execute_wrapper(lambda execute, *args: execute(*args[:-1])):
        assert not isinstance(backend.statement_cursor(connection), LeanCursor)
    connection.close()
    connection.ensure_connection()
    assert backend.statement_cursor(connection) is not lean, "a new session, a new cursor"


def in_thread_once_waiting(body: Any) -> tuple[threading.Thread, list[Any]]:
    """Run ``body()`` in a thread of its own connection; return once its first statement
    has started (sqlite3's trace callback fires as a statement begins, before it asks for
    the write lock), with the list that gets its result or exception."""
    started = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            own = connections["default"]
            own.ensure_connection()
            own.connection.set_trace_callback(lambda sql: started.set())
            outcome.append(body())
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            outcome.append(exc)
        finally:
            started.set()
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(30)
    # The scenario: the waiter stays blocked behind the other process for a while, so a
    # clock read before the wait would be this much earlier than the holder's commit.
    time.sleep(0.1)
    return thread, outcome


@pytest.mark.parametrize("path", ["one statement", "fallback"])
def test_the_clock_is_read_after_another_processs_write_lock(holder, request, path):
    """The frozen-clock trap with a real second process: a grant that waited for the write
    lock is stamped after the holder's commit, not when its statement began."""
    if path == "fallback":
        request.getfixturevalue("old_sqlite")
    acquire("waited", ttl=30).release()
    blocker = holder()
    thread, outcome = in_thread_once_waiting(lambda: acquire("waited", ttl=0.5))
    released_us = blocker.commit()
    thread.join(30)
    (lease,) = outcome
    row = Lock.objects.get(name="waited")
    assert row.owner == lease.owner
    assert row.acquired_us >= released_us, "the grant's clock was read before the lock"
    assert row.expires_us >= released_us + 400_000, "lease was expired at birth"
    lease.release()


@pytest.mark.parametrize("path", ["one statement", "fallback"])
def test_a_grant_committed_while_waiting_is_seen(holder, request, path):
    """The other process grants the free lock in the transaction the acquire waits for:
    the acquire decides on that committed row (busy), never on what it saw before."""
    if path == "fallback":
        request.getfixturevalue("old_sqlite")
    acquire("raced", ttl=30).release()
    blocker = holder(
        "UPDATE distlock_lock SET token = token + 1, owner = 'thief', holder = 'thief', "
        "expires_us = expires_us + 3600000000 * 1000 WHERE name = 'raced'"
    )
    thread, outcome = in_thread_once_waiting(lambda: acquire("raced", ttl=30, blocking=False))
    blocker.commit()
    thread.join(30)
    assert outcome == [None], "granted over a lease committed while it waited"
    assert Lock.objects.get(name="raced").owner == "thief"


def test_the_busy_timeout_still_ends_a_wait_with_operational_error(holder):
    """A second process holds the write lock longer than the busy timeout: the grant fails
    with 'database is locked' and changes nothing (the lean cursor keeps the timeout)."""
    acquire("stuck", ttl=30).release()
    before = Lock.objects.filter(name="stuck").values_list("token", "owner").get()
    blocker = holder()
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout = 200")
    try:
        began = time.monotonic()
        with pytest.raises(OperationalError, match="locked"):
            acquire("stuck", ttl=30, blocking=False)
        assert time.monotonic() - began >= 0.15, "it did not wait for the busy timeout"
    finally:
        blocker.commit()
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout = 30000")
    assert Lock.objects.filter(name="stuck").values_list("token", "owner").get() == before
    lease = acquire("stuck", ttl=30, blocking=False)
    assert lease is not None and lease.token == before[0] + 1
    lease.release()


@pytest.mark.django_db(transaction=True, databases=["default", "locks"])
@pytest.mark.parametrize("opening", ["atomic", "manual"])
@pytest.mark.parametrize("alias", ["default", "locks"])
def test_every_path_is_refused_in_the_callers_transaction(opening, alias, old_sqlite_or_not):
    """Inside atomic() or with autocommit off — on the lock alias itself or on another
    alias of the same file (the 'locks' mirror) — nothing is granted, renewed or released,
    on the one-statement path as on the fallback."""
    lease = acquire("inside", ttl=30, using=alias)
    before = list(Lock.objects.values_list("name", "token", "owner", "expires_us"))
    attempts = [
        lambda: acquire("inside:other", ttl=30, using=alias),
        lambda: lease.renew(ttl=60),
        lambda: lease.release(),
    ]
    for attempt in attempts:
        if opening == "atomic":
            with pytest.raises(TransactionNotAllowed), transaction.atomic():
                Resource.objects.create(name="inside")  # the caller holds the write lock
                attempt()
        else:
            transaction.set_autocommit(False)
            try:
                Resource.objects.create(name="inside")
                with pytest.raises(TransactionNotAllowed):
                    attempt()
            finally:
                transaction.rollback()
                transaction.set_autocommit(True)
    assert list(Lock.objects.values_list("name", "token", "owner", "expires_us")) == before
    assert not Resource.objects.exists()
    assert lease.release() is True


@pytest.fixture(params=["one statement", "fallback"])
def old_sqlite_or_not(request: pytest.FixtureRequest) -> None:
    if request.param == "fallback":
        request.getfixturevalue("old_sqlite")


def test_fallback_answers_as_the_one_statement_path(old_sqlite_or_not):
    """First use, grant, busy, take-over (with its holder reported), renew, release of a
    live and of an expired lease: the same answers on both paths."""
    first = acquire("same", ttl=30, holder="first")
    assert acquire("same", ttl=30, blocking=False) is None
    first.release()
    second = acquire("same", ttl=30)
    assert second.token == first.token + 1
    second.renew(ttl=60)
    assert second.release() is True
    assert second.release() is False

    slow = expired_lock("same:expired", holder="slow")
    received: list[str] = []

    def record(sender: Any, lease: Any, took_over: str, **kwargs: Any) -> None:
        received.append(took_over)

    signals.lock_acquired.connect(record)
    try:
        taker = acquire("same:expired", ttl=30)
    finally:
        signals.lock_acquired.disconnect(record)
    assert received == [slow.holder] and taker.token == slow.token + 1
    assert slow.release() is False
    taker_row = Lock.objects.get(name="same:expired")
    assert taker_row.owner == taker.owner, "a stale release freed the new holder's lock"
    make_stale(taker)
    assert taker.release() is False
    assert Lock.objects.get(name="same:expired").owner == ""


def test_the_folded_check_refuses_a_stale_write_in_its_own_statement():
    """The ownership check is inside the fenced UPDATE: an expired lease writes nothing,
    even to a row nobody else wrote, and the refusal came from that one statement."""
    lease = acquire("stale:row", ttl=30)
    Resource.objects.create(name="stale:row")
    assert Resource.objects.filter(name="stale:row").fenced_update(lease, value=F("value") + 1)
    make_stale(lease)
    with CaptureQueriesContext(connection) as captured, pytest.raises(StaleToken):
        Resource.objects.filter(name="stale:row").fenced_update(lease, value=F("value") + 1)
    update = _sql(captured)[0]
    assert update.startswith("UPDATE") and "EXISTS (SELECT 1 FROM distlock_lock" in update
    assert Resource.objects.get(name="stale:row").value == 1
    assert lease.lost

    # Taken over by another holder: the old lease's write is refused, the new one's not.
    taker = acquire("stale:row", ttl=30)
    with pytest.raises(StaleToken):
        Resource.objects.filter(name="stale:row").fenced_update(lease, value=F("value") + 1)
    assert Resource.objects.filter(name="stale:row").fenced_update(taker, value=F("value") + 1)
    assert Resource.objects.get(name="stale:row").value == 2
    taker.release()


def test_a_take_over_committed_while_the_folded_write_waits_refuses_it(holder):
    """Another process takes the lock over in the transaction the one-statement fenced write
    waits for: the write's ownership check runs after that commit and refuses it."""
    lease = acquire("held:row", ttl=30)
    Resource.objects.create(name="held:row")
    blocker = holder(
        "UPDATE distlock_lock SET token = token + 1, owner = 'thief', holder = 'thief' "
        "WHERE name = 'held:row'"
    )
    thread, outcome = in_thread_once_waiting(
        lambda: Resource.objects.filter(name="held:row").fenced_update(lease, value=1)
    )
    blocker.commit()
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], StaleToken), outcome
    row = Resource.objects.get(name="held:row")
    assert (row.value, row.fence_token) == (0, 0)


def test_the_fallback_keeps_the_take_over_boundary_and_the_token_floor(old_sqlite, monkeypatch):
    """The portable steps of backends/base.py run on SQLite only as its fallback (SQLite <
    3.35; MariaDB runs procedures, PostgreSQL functions): the boundary and floor tests of
    the one-statement path, run again through them, hold them to the same promises."""
    from tests import test_boundaries, test_locks

    clock = test_boundaries.Clock()
    backend = backend_for(connections["default"])
    real = backend.now_sql
    monkeypatch.setattr(
        backend, "now_sql", lambda: real() if clock.us is None else str(clock.us)
    )
    test_locks.test_purge_keeps_tokens_increasing()  # first: it wants an empty table
    test_boundaries.test_take_over_is_refused_until_expiry_and_granted_at_it(clock)


class _Retries(logging.Handler):
    """Counts the purge's "running it again" warnings; set() after the first."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.first = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "running it again" in record.getMessage():
            self.count += 1
            self.first.set()


@pytest.fixture
def retries() -> Iterator[_Retries]:
    handler = _Retries()
    logger = logging.getLogger("distlock")
    logger.addHandler(handler)
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout = 200")
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout = 30000")


def _purge_rows_and_events() -> Callable[[], int]:
    """Idle lock rows and old events; what purges them (both purges share the retry)."""
    Lock.objects.bulk_create(
        Lock(name=f"idle:{i}", token=i + 1, expires_us=1) for i in range(5)
    )
    LockEvent.objects.bulk_create(
        LockEvent(at_us=i + 1, kind=LockEvent.Kind.ACQUIRED, name=f"idle:{i}") for i in range(5)
    )
    return lambda: purge_locks(idle=0) + purge_events(older_than=0)


def test_a_purge_runs_a_batch_again_after_the_busy_timeout(holder, retries):
    """Another process holds the write lock past the busy timeout: the batch fails with
    'database is locked', is run again, and the purge finishes once the lock is let go."""
    purge = _purge_rows_and_events()
    blocker = holder()
    released: list[int] = []

    def release_after_the_first_retry() -> None:
        if retries.first.wait(60):
            released.append(blocker.commit())

    releaser = threading.Thread(target=release_after_the_first_retry)
    releaser.start()
    try:
        assert purge() == 10
    finally:
        releaser.join(60)
    assert released and 1 <= retries.count <= PURGE_BUSY_RETRIES
    assert not Lock.objects.exists() and not LockEvent.objects.exists()


def test_a_purge_gives_up_after_its_retries(holder, retries):
    """Held for good, the lock ends the purge after PURGE_BUSY_RETRIES more tries, with
    the error, and nothing deleted."""
    purge = _purge_rows_and_events()
    blocker = holder()
    try:
        with pytest.raises(OperationalError, match="locked"):
            purge()
        assert retries.count == PURGE_BUSY_RETRIES
    finally:
        blocker.commit()
    assert Lock.objects.count() == 5 and LockEvent.objects.count() == 5
    # The floor was not raised by the failed batches (their transactions rolled back).
    assert TokenFloor.objects.filter(token__gte=1).count() == 0


def test_a_purge_in_the_callers_transaction_is_not_run_again(holder, retries):
    """Inside the caller's atomic block the failed statement spoilt the transaction: the
    error goes to the caller at once."""
    _purge_rows_and_events()
    blocker = holder()
    try:
        with pytest.raises(OperationalError, match="locked"), transaction.atomic():
            purge_events(older_than=0)
        assert retries.count == 0
    finally:
        blocker.commit()
    assert LockEvent.objects.count() == 5


def test_a_purge_with_autocommit_off_is_not_run_again(holder, retries):
    """With autocommit turned off by hand the purge's statements join the caller's
    transaction, as inside atomic(): the error goes to the caller at once, not after
    batches run again (or polled for) outside it."""
    _purge_rows_and_events()
    blocker = holder()
    try:
        transaction.set_autocommit(False)
        try:
            with pytest.raises(OperationalError, match="locked"):
                purge_events(older_than=0)
            assert retries.count == 0
        finally:
            transaction.rollback()
            transaction.set_autocommit(True)
    finally:
        blocker.commit()
    assert LockEvent.objects.count() == 5


def _busy_timeout_ms() -> int:
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA busy_timeout")
        return int(cursor.fetchone()[0])


def test_the_polled_batch_gives_up_at_the_busy_timeout_and_puts_it_back(holder, retries):
    """Another process holds the write lock: the purge's own polling ends at the busy
    timeout (200 ms, from the ``retries`` fixture) each try, the purge then fails with
    "database is locked" and the count deleted so far, nothing of the batch written, and
    the connection's busy timeout is 200 ms again (the polling set it to 0)."""
    Lock.objects.bulk_create(Lock(name=f"idle:{i}", token=i + 1, expires_us=1) for i in range(3))
    blocker = holder()
    try:
        started = time.monotonic()
        with pytest.raises(OperationalError, match="database is locked.*0 rows deleted"):
            purge_locks(idle=0)
        took = time.monotonic() - started
        assert retries.count == PURGE_BUSY_RETRIES
        # 1 + PURGE_BUSY_RETRIES tries of 200 ms each.
        assert took >= 0.2 * (1 + PURGE_BUSY_RETRIES) * 0.9, took
        assert _busy_timeout_ms() == 200
    finally:
        blocker.commit()
    assert Lock.objects.count() == 3


def test_the_polled_batch_puts_the_busy_timeout_back_after_a_batch(retries):
    """After a batch that got the lock at once, the busy timeout is what it was."""
    Lock.objects.bulk_create(Lock(name=f"idle:{i}", token=i + 1, expires_us=1) for i in range(3))
    assert purge_locks(idle=0) == 3
    assert _busy_timeout_ms() == 200
    assert retries.count == 0


def test_a_purge_in_the_callers_transaction_is_refused_before_any_batch():
    """purge_locks() inside atomic() is refused as before, before anything is polled."""
    Lock.objects.bulk_create(Lock(name=f"idle:{i}", token=i + 1, expires_us=1) for i in range(3))
    with pytest.raises(TransactionNotAllowed), transaction.atomic():
        purge_locks(idle=0)
    assert Lock.objects.count() == 3
    assert _busy_timeout_ms() == 30000


def test_the_purge_polls_for_the_write_lock_itself(holder):
    """While another process holds the write lock, a purge batch asks for it again and
    again (its own polling, with the busy timeout at 0 meanwhile) rather than waiting in
    one BEGIN IMMEDIATE through SQLite's busy handler, whose ever longer sleeps lose the
    lock to a writer that commits back to back. The holder lets go only once it has seen
    three tries: a batch waiting in the busy handler (30 s here) makes one, so no race
    decides the outcome."""
    Lock.objects.bulk_create(Lock(name=f"idle:{i}", token=i + 1, expires_us=1) for i in range(3))
    tries: list[str] = []
    purged: list[int] = []

    def count(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.startswith("BEGIN"):
            tries.append(sql)
        return execute(sql, params, many, context)

    def purge() -> None:
        try:
            with connection.execute_wrapper(count):
                purged.append(purge_locks(idle=0))
        finally:
            connections.close_all()

    blocker = holder()
    thread = threading.Thread(target=purge)
    try:
        thread.start()
        wait_until(lambda: len(tries) >= 3, 10, "the purge asking again for the write lock")
    finally:
        blocker.commit()
        thread.join(60)
    assert not thread.is_alive()
    assert purged == [3]
    assert Lock.objects.count() == 0
