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
- a holder's local deadline counts from before a long round trip, not after it.

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
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock import LockLost, acquire, break_lock, signals
from distlock.backends import backend_for
from distlock.backends.results import Grant
from distlock.constants import LOCK_TABLE
from distlock.core.leases import Lease
from distlock.db import db_now_us
from distlock.models import Lock
from tests.support.helpers import us, wait_until

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
