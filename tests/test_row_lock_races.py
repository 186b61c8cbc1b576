"""Operations that wait for the lock row while another transaction changes it.

Each test holds the lock row in a transaction of its own (``SELECT … FOR UPDATE`` on
PostgreSQL and MariaDB; on SQLite a write, which holds the file's one write lock), starts
a lock operation in a thread, waits until the database shows that operation waiting for
the row, then changes the row in the holding transaction and commits. The operation must
decide on the row as committed, never on what it read before the wait:

- a break of a grant that was released and granted again meanwhile breaks nothing (a
  break without its row lock reads the old grant, then its UPDATE matches no row, and it
  reports a break that never happened — the release *and* the break would both say they
  ended the grant);
- an acquire that waited behind a short grant (less than a second left) is refused
  (PostgreSQL's ``distlock_acquire`` decides again after its row lock, where a plain read
  before the wait had seen the lock free);
- a holder's local deadline counts from before a long round trip, not after it;
- a purge whose delete waited behind a grant and release of a row it found idle keeps
  that row (its token is above the floor the purge committed), so the name never comes
  back with the token of that grant.

The token floor's share lock is the other way round: a first use of a name, stopped
between its floor read and its insert (a test-only trigger holds its insert at a gate), is
what a purge must wait for, or a name created, freed and purged meanwhile comes back
with a token it already had.

On SQLite nothing can show that a connection waits for the write lock, so the operation
is only known to have *started* after the holder took the lock. Every operation there
begins with ``BEGIN IMMEDIATE``, so it runs after the holder's commit either way: the
tests check that outcome, which is the guarantee SQLite gives instead of row locks.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock import LockLost, acquire, break_lock, purge_locks, signals
from distlock.backends import backend_for
from distlock.backends.results import Grant
from distlock.constants import FLOOR_ID, LOCK_TABLE
from distlock.core.leases import Lease
from distlock.db import db_now_us
from distlock.models import Lock, TokenFloor
from tests.support.helpers import lock_waits, us, wait_until

pytestmark = pytest.mark.usefixtures("lock_db")

# How long the round-trip test keeps its operation waiting: far above scheduling noise.
LONG_WAIT = 0.5


class Holder:
    """A transaction on its own connection that holds one lock row until it ends."""

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self.connection = connection
        self.cursor = connection.cursor()
        self.backend = backend_for(connection)

    def commit(self) -> None:
        self.connection.commit()

    def rollback(self) -> None:
        self.connection.rollback()


@contextmanager
def holding_row(name: str) -> Iterator[Holder]:
    """Hold lock row ``name`` (on SQLite: the write lock) until commit() or the block ends."""
    connection = connections.create_connection("default")
    connection.set_autocommit(False)
    try:
        holder = Holder(connection)
        if connection.vendor == "sqlite":
            holder.cursor.execute(
                f"UPDATE {LOCK_TABLE} SET holder = holder WHERE name = %s", [name]
            )
        else:
            holder.cursor.execute(
                f"SELECT token FROM {LOCK_TABLE} WHERE name = %s FOR UPDATE", [name]
            )
        yield holder
    finally:
        connection.rollback()
        connection.close()


class Contender(threading.Thread):
    """Runs one lock operation on its own connection and says when it waits for a row."""

    def __init__(self, body: Callable[[], Any]) -> None:
        super().__init__(name="contender", daemon=True)
        self.body = body
        self.session: int | None = None
        self.began: float | None = None
        self.outcome: dict[str, Any] = {}

    def run(self) -> None:
        try:
            connection = connections["default"]
            if connection.vendor == "mysql":
                with connection.cursor() as cursor:
                    cursor.execute("SELECT CONNECTION_ID()")
                    self.session = cursor.fetchone()[0]
            self.began = time.monotonic()
            self.outcome["value"] = self.body()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            self.outcome["error"] = exc
        finally:
            connections.close_all()

    def waiting(self) -> bool:
        """True once the database shows this thread's statement waiting for a row lock
        (on SQLite: once the operation has started, see the module docstring)."""
        if self.began is None:
            return False
        connection = connections["default"]
        if connection.vendor == "sqlite":
            return True
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                # By the statement, not by a backend pid read before it: behind a
                # transaction pooler (the PgBouncer pass) each statement may run on another
                # server session. Only the contender waits for a row here.
                cursor.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE %s",
                    ["%distlock%"],
                )
            else:
                cursor.execute(
                    "SELECT 1 FROM information_schema.innodb_trx "
                    "WHERE trx_mysql_thread_id = %s AND trx_state = 'LOCK WAIT'",
                    [self.session],
                )
            return cursor.fetchone() is not None

    def wait_blocked(self, at_least: float = 0.0) -> None:
        """Wait until the operation waits for the row (for ``at_least`` seconds)."""
        # InnoDB refreshes information_schema.innodb_trx only when it was last read more
        # than 0.1 s ago: polled faster, it would show the same snapshot for ever.
        every = 0.15 if connections["default"].vendor == "mysql" else 0.01
        wait_until(self.waiting, 10, "the operation waiting for the lock row", every=every)
        assert self.began is not None
        wait_until(lambda: time.monotonic() - self.began >= at_least, 10 + at_least,
                   "the long wait")

    def result(self) -> Any:
        self.join(30)
        assert not self.is_alive(), "the operation did not finish after the row was freed"
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["value"]


def new_owner() -> str:
    return os.urandom(16).hex()


def test_a_break_waiting_behind_a_release_and_reacquire_breaks_nothing():
    old = acquire("race:break", ttl=30, holder="old")
    broken: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> None:
        broken.append(kwargs)

    signals.lock_broken.connect(record, dispatch_uid="test-race-break")
    try:
        owner = new_owner()
        with holding_row("race:break") as held:
            breaker = Contender(
                lambda: break_lock("race:break", owner=old.owner, token=old.token)
            )
            breaker.start()
            breaker.wait_blocked()
            # The old holder releases and a newcomer is granted, in the row lock's
            # transaction: exactly what the break waits behind.
            released = held.backend.release(held.cursor, "race:break", old.owner, old.token)
            grant = held.backend.acquire_existing(
                held.cursor, "race:break", owner, "newcomer", 30_000_000
            )
            held.commit()
        assert released[0] is True, "the release ended the old grant"
        assert isinstance(grant, Grant) and grant.token == old.token + 1
        assert breaker.result() is False, "the break reported ending a grant already released"
    finally:
        signals.lock_broken.disconnect(dispatch_uid="test-race-break")
    assert broken == []
    row = Lock.objects.get(name="race:break")
    assert (row.owner, row.token, row.holder) == (owner, old.token + 1, "newcomer")
    assert row.expires_us == grant.expires_us, "the new grant must be left as granted"
    assert old.release() is False
    assert Lease("race:break", owner, grant.token, using="default", ttl=30).release() is True


def test_an_acquire_waiting_behind_a_short_grant_is_refused():
    """The grant it waited behind has under a second left: still busy, not free."""
    acquire("race:short", ttl=30).release()
    owner = new_owner()
    with holding_row("race:short") as held:
        taker = Contender(lambda: acquire("race:short", ttl=5, blocking=False))
        taker.start()
        taker.wait_blocked()
        grant = held.backend.acquire_existing(held.cursor, "race:short", owner, "short", 800_000)
        held.commit()
    assert isinstance(grant, Grant)
    lease = taker.result()
    if lease is not None:
        # Only right if this machine stalled the taker past the short lease's end.
        assert us(lease.acquired_at) >= grant.expires_us, "granted over a live lease"
        lease.release()
    else:
        row = Lock.objects.get(name="race:short")
        assert (row.owner, row.token) == (owner, grant.token)


@pytest.mark.parametrize("operation", ["acquire", "renew"])
def test_the_holders_timer_starts_before_a_long_round_trip(operation):
    """The local deadline counts from before the request left, however long it waited.

    A timer started when the answer came back would end ``LONG_WAIT`` seconds late.
    """
    ttl = 5.0
    first = acquire("race:timer", ttl=ttl)
    if operation == "acquire":
        first.release()

    def call() -> tuple[float, Lease, float, float]:
        before = time.monotonic()
        if operation == "acquire":
            lease = acquire("race:timer", ttl=ttl, blocking=False)
            assert lease is not None
        else:
            first.renew(ttl)
            lease = first
        left = lease.remaining()
        return before, lease, left, time.monotonic()

    with holding_row("race:timer") as held:
        contender = Contender(call)
        contender.start()
        contender.wait_blocked(at_least=LONG_WAIT)
        held.rollback()
    before, lease, left, after = contender.result()
    assert after - before >= LONG_WAIT, "the round trip was not long"
    # after + left is at least the deadline: the deadline is at most ttl past ``before``
    # (0.1 s for what acquire does before it sends the request, on a loaded machine).
    assert after + left <= before + ttl + 0.1, (
        f"the holder's timer started {after + left - before - ttl:.3f} s late"
    )
    row = Lock.objects.get(name="race:timer")
    assert row.token == lease.token
    assert lease.release() is True


def test_a_renewal_waiting_for_the_row_past_the_lease_s_end_is_refused():
    """A renewal waits for the lock row while another renewal of the same lease (say, by
    another thread of the holder) shortens it to 0.3 s in the transaction that holds the
    row, which commits only after the database clock has passed that end. The waiting
    renewal must judge by a clock read after its wait: refused as expired, changing
    nothing. A clock read when it arrived — before its locking read, or PostgreSQL's
    ``now()``, frozen at the statement's start — came before the short renewal was even
    made, so it would renew a lease that had ended (anyone could have been granted the
    lock in between). However late the renewal starts, its arrival precedes that end."""
    name = "race:renew-late"
    lease = acquire(name, ttl=30)
    with holding_row(name) as held:
        renewer = Contender(lambda: lease.renew(ttl=30))
        renewer.start()
        renewer.wait_blocked()
        short = held.backend.renew(held.cursor, name, lease.owner, lease.token, 300_000)
        assert isinstance(short, Grant)
        wait_until(lambda: db_now_us("default") > short.expires_us, 10,
                   "the shortened lease's end by the database clock")
        assert renewer.is_alive(), "the renewal did not wait for the row"
        held.commit()
    with pytest.raises(LockLost, match="expired"):
        renewer.result()
    row = Lock.objects.get(name=name)
    assert (row.owner, row.token) == (lease.owner, lease.token)
    assert (row.expires_us, row.renew_count) == (short.expires_us, 1), (
        "the ended lease was renewed")


# -- the token floor and purge: a first use, a purge, and a grant between them -------------

# A test-only gate inside a first use: a BEFORE INSERT trigger on the lock table that, for
# a row whose holder says "gated", takes a share lock on the one row of a gate table. While
# the test holds that row FOR UPDATE, such an insert waits there: after the first use has
# read the token floor, before its row exists.
_GATE_SQL = {
    "postgresql": [
        "CREATE TABLE distlock_test_gate (id integer PRIMARY KEY)",
        "INSERT INTO distlock_test_gate VALUES (1)",
        """CREATE FUNCTION distlock_test_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM distlock_test_gate WHERE id = 1 FOR SHARE;
    RETURN NEW;
END $$""",
        f"""CREATE TRIGGER distlock_test_gate BEFORE INSERT ON {LOCK_TABLE} FOR EACH ROW
    WHEN (NEW.holder LIKE '%gated%') EXECUTE FUNCTION distlock_test_gate()""",
    ],
    "mysql": [
        "CREATE TABLE distlock_test_gate (id INT PRIMARY KEY) ENGINE=InnoDB",
        "INSERT INTO distlock_test_gate VALUES (1)",
        f"""CREATE TRIGGER distlock_test_gate BEFORE INSERT ON {LOCK_TABLE} FOR EACH ROW
BEGIN
    DECLARE v_gate INT;
    IF NEW.holder LIKE '%gated%' THEN
        SELECT id INTO v_gate FROM distlock_test_gate WHERE id = 1 LOCK IN SHARE MODE;
    END IF;
END""",
    ],
}
_UNGATE_SQL = {
    "postgresql": [
        f"DROP TRIGGER IF EXISTS distlock_test_gate ON {LOCK_TABLE}",
        "DROP FUNCTION IF EXISTS distlock_test_gate()",
        "DROP TABLE IF EXISTS distlock_test_gate",
    ],
    "mysql": [
        "DROP TRIGGER IF EXISTS distlock_test_gate",
        "DROP TABLE IF EXISTS distlock_test_gate",
    ],
}


@pytest.fixture
def insert_gate() -> Iterator[Callable[[], AbstractContextManager[None]]]:
    """Install the gate (above) for the test; yields ``closed()``, a context manager that
    holds the gate shut (its row FOR UPDATE on a connection of its own) for its block."""
    vendor = connections["default"].vendor
    if vendor == "sqlite":
        pytest.skip(
            "SQLite has one writer: a first use holds the write lock from its floor read to "
            "its commit, so no purge can come between them"
        )
    with connections["default"].cursor() as cursor:
        for sql in _GATE_SQL[vendor]:
            cursor.execute(sql)

    @contextmanager
    def closed() -> Iterator[None]:
        connection = connections.create_connection("default")
        connection.set_autocommit(False)
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT id FROM distlock_test_gate WHERE id = 1 FOR UPDATE")
            yield
        finally:
            connection.rollback()
            connection.close()

    try:
        yield closed
    finally:
        with connections["default"].cursor() as cursor:
            for sql in _UNGATE_SQL[vendor]:
                cursor.execute(sql)


def _waits_for_the_floor(purger: Contender) -> bool:
    """Does the purge wait for a lock (the floor's, here) beside the gated first use?"""
    if connections["default"].vendor == "postgresql":
        # By count, not by pid (see Contender.waiting): the first use waits at the gate.
        return lock_waits() >= 2
    return purger.waiting()


def test_a_purge_waits_for_a_first_use_between_its_floor_read_and_its_insert(insert_gate):
    """A first use of a name reads the token floor under a share lock held to its commit,
    so a purge cannot raise the floor and delete rows while a first use is between its
    floor read and its insert. Without it: the first use reads floor f and stops (here at
    the gate); meanwhile another acquire creates the name with token f + 1, frees it, and
    a purge raises the floor to f + 1 and deletes the row; the first use then inserts the
    name with f + 1 — a token of that name issued twice (fencing lets both holders write).
    """
    name = "race:first-use"
    # The floor row must exist (a flush between tests empties it): a first use that puts
    # it back holds that row's insert to its commit, and any other first use waits for it.
    TokenFloor.objects.update_or_create(id=FLOOR_ID, defaults={"token": 100})
    first = Contender(lambda: acquire(name, ttl=30, holder="gated"))
    purger = Contender(lambda: purge_locks(idle=0))
    with insert_gate():
        first.start()
        first.wait_blocked()  # at the gate: it has read the floor, its row is not in yet
        other = acquire(name, ttl=30)
        assert other.release() is True
        purger.start()
        # InnoDB refreshes information_schema.innodb_trx at most every 0.1 s.
        every = 0.15 if connections["default"].vendor == "mysql" else 0.01
        wait_until(lambda: not purger.is_alive() or _waits_for_the_floor(purger), 10,
                   "the purge waiting or done", every=every)
        assert purger.is_alive(), (
            "the purge raised the floor and deleted while a first use was between its "
            "floor read and its insert"
        )
    # The gate is open: the first use goes on, then the purge.
    lease = first.result()
    purger.result()
    assert other.token == 101
    assert lease.token == other.token + 1, (
        f"the first use got token {lease.token}, after {other.token} was granted and purged"
    )
    row = Lock.objects.get(name=name)
    assert (row.owner, row.token) == (lease.owner, lease.token)
    assert lease.release() is True


def test_a_purge_keeps_a_name_granted_and_freed_between_its_look_and_its_delete():
    """A purge deletes only rows at or below the floor its first step committed. A name
    the look found idle, then granted and freed before the delete (which waits for its row
    here), has a token above that floor: deleting it would let the name come back at
    floor + 1, the token of the grant in between. (On SQLite the look and the delete are
    one transaction under the write lock: the grant comes before the look, the floor
    covers it, and the row may go.)"""
    name = "race:purge"
    old = acquire(name, ttl=30)
    assert old.release() is True
    owner = new_owner()
    with holding_row(name) as held:
        purger = Contender(lambda: purge_locks(idle=0))
        purger.start()
        purger.wait_blocked()  # looked, raised the floor to old.token; the delete waits
        grant = held.backend.acquire_existing(held.cursor, name, owner, "between", 30_000_000)
        assert isinstance(grant, Grant) and grant.token == old.token + 1
        held.backend.release(held.cursor, name, owner, grant.token)
        held.commit()
    purged = purger.result()
    if connections["default"].vendor != "sqlite":
        assert purged == 0, "the purge deleted a row granted after its look"
        assert Lock.objects.get(name=name).token == grant.token
    again = acquire(name, ttl=30)
    assert again.token == grant.token + 1, (
        f"{name} came back with token {again.token} after {grant.token} was granted"
    )
    assert again.release() is True
