"""The seam matrix: every lock operation and fenced write form in every caller context.

Contexts: autocommit, ``atomic()``, nested ``atomic()``, ``set_autocommit(False)`` and a
view under ``ATOMIC_REQUESTS`` (through the test client), each with the lock table on the
data's own alias ("same") or on a second alias of the same database ("separate",
``DISTLOCK_DATABASE = "locks"``). Each cell runs in a thread of its own under a deadline
(a hang fails it) and then checks, whatever the cell did:

- every grant seen has a token above every earlier grant of that name, and a fresh grant
  afterwards gets a higher token still (a grant rolled back with the caller's transaction
  would hand its token out again);
- no lease exists that the database lacks: a lease the cell still holds is the row's
  owner and token;
- an acknowledged fenced write (the call returned and the caller committed) is stored
  with its token; a rolled-back one is not;
- or the cell raised the documented error (TransactionNotAllowed) and changed nothing.

The expected outcome of each cell is written in ``expected_lock_outcome`` and
``write_plan``; the README's "Transactions" section says the same in words.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connections, transaction
from django.test import Client

from distlock import (
    StaleToken,
    TransactionNotAllowed,
    acquire,
    break_lock,
    purge_locks,
    signals,
)
from distlock.core import uncommitted
from distlock.core.leases import Lease
from distlock.db import db_now_us
from distlock.models import Lock
from tests import urls
from tests.support.helpers import expired_lock, run_with_deadline, wait_until
from tests.testapp.models import Account, Order

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "locks"])

CONTEXTS = ["autocommit", "atomic", "nested_atomic", "manual", "atomic_requests"]
ALIASES = ["same", "separate"]
LOCK_OPS = [
    "acquire", "blocking_acquire", "renew", "auto_renew", "release", "break", "purge",
]
WRITES = ["save", "fenced_update", "fenced_create", "delete", "fenced_delete", "bulk"]
_serial = itertools.count(1)


class _Rollback(Exception):
    """Ends the caller's transaction with a rollback (carries the body's result)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self.result = result


@pytest.fixture
def grants() -> Iterator[list[Lease]]:
    """Every lease granted while the test runs, in grant order (any thread)."""
    seen: list[Lease] = []

    def receiver(sender: Any, lease: Lease, **kwargs: Any) -> None:
        seen.append(lease)

    signals.lock_acquired.connect(receiver, weak=False)
    try:
        yield seen
    finally:
        signals.lock_acquired.disconnect(receiver)


@pytest.fixture
def setup(request: pytest.FixtureRequest, settings: Any, monkeypatch: Any):
    """Point distlock at the cell's lock alias and allow ATOMIC_REQUESTS to be switched on."""

    def configure(alias: str, context: str) -> str:
        settings.DISTLOCK_DATABASE = "locks" if alias == "separate" else None
        if context == "atomic_requests":
            monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)
        return f"seam-{next(_serial)}-{request.node.callspec.id}"[:200]

    return configure


def in_context(context: str, end: str, body: Callable[[], Any]) -> Any:
    """Run ``body`` in the caller's ``context`` on the data alias; end it by ``end``."""
    if context == "autocommit":
        return body()
    if context == "manual":
        transaction.set_autocommit(False)
        try:
            result = body()
        except BaseException:
            transaction.rollback()
            raise
        else:
            (transaction.commit if end == "commit" else transaction.rollback)()
            return result
        finally:
            transaction.set_autocommit(True)
    if context == "atomic_requests":

        def view() -> Any:
            result = body()
            if end == "rollback":
                raise _Rollback(result)
            return result

        urls.seam_view_body = view
        try:
            response = Client().get("/seam/")
        except _Rollback as rollback:
            return rollback.result
        finally:
            urls.seam_view_body = None
        assert response.status_code == 200
        return urls.seam_view_result
    try:
        with transaction.atomic():
            if context == "nested_atomic":
                with transaction.atomic():
                    result = body()
            else:
                result = body()
            if end == "rollback":
                raise _Rollback(result)
    except _Rollback as rollback:
        return rollback.result
    return result


def rows() -> list[tuple[Any, ...]]:
    return sorted(Lock.objects.values_list("name", "token", "owner", "expires_us"))


def assert_grants_sound(grants: list[Lease], names: set[str], still_held: list[Lease]) -> None:
    """No token granted twice; no lease the database lacks; the next grant goes higher."""
    for name in names:
        tokens = [lease.token for lease in grants if lease.name == name]
        assert tokens == sorted(set(tokens)), f"{name}: tokens {tokens} repeat or go down"
    now = db_now_us("default")
    for lease in still_held:
        row = Lock.objects.get(name=lease.name)
        assert (row.owner, row.token) == (lease.owner, lease.token) or row.expires_us <= now, (
            f"lease {lease.name} token {lease.token} exists only in Python "
            f"(the row has token {row.token})"
        )
    for name in names:
        break_lock(name)
        top = max((lease.token for lease in grants if lease.name == name), default=0)
        fresh = acquire(name, ttl=30, blocking=False)
        assert fresh is not None and fresh.token > top, (
            f"{name}: a fresh grant got token {fresh and fresh.token}, not above {top}"
        )
        fresh.release()


# -- lock operations ---------------------------------------------------------------------


def expected_lock_outcome(op: str, context: str, alias: str) -> str:
    """"works", or "refused" (TransactionNotAllowed, nothing changed)."""
    if context == "autocommit" or op == "auto_renew":
        # The renewer is a thread with its own connection, always in autocommit.
        return "works"
    if alias == "same":
        return "refused"
    # A second connection to one SQLite file would wait for the caller's write lock.
    return "refused" if connections["default"].vendor == "sqlite" else "works"


def prepare_lock_op(op: str, name: str) -> dict[str, Any]:
    """What the operation needs before the caller's context opens (in autocommit)."""
    if op == "blocking_acquire":
        return {"holder": acquire(name, ttl=0.3)}
    if op in ("renew", "release", "break"):
        return {"lease": acquire(name, ttl=30)}
    if op == "auto_renew":
        # 1.5 s: the renewer's first renewal (a new thread, so a new connection) is due at
        # 0.5 s and has a second to commit. With 0.6 s it had 0.4 s, which a loaded CI
        # machine's connection set-up exceeded (the lease was lost, not renewed).
        lease = acquire(name, ttl=1.5, auto_renew=True)
        return {"lease": lease, "expires": lease.expires_at}
    if op == "purge":
        acquire(name, ttl=30)
        break_lock(name)
        # A held lock beside it, which purge must leave alone.
        acquire(f"{name}:top", ttl=30)
        return {}
    return {}


def run_lock_op(op: str, name: str, prep: dict[str, Any]) -> Any:
    if op == "acquire":
        lease = acquire(name, ttl=30, blocking=False)
        assert lease is not None
        return lease
    if op == "blocking_acquire":
        lease = acquire(name, ttl=30, timeout=10)
        assert lease is not None
        return lease
    if op == "renew":
        prep["lease"].renew(ttl=60)
        return prep["lease"]
    if op == "auto_renew":
        lease = prep["lease"]
        if connections["default"].vendor != "sqlite" or not transaction.get_connection(
        ).in_atomic_block:
            wait_until(lambda: lease.expires_at > prep["expires"], 10, "a renewal")
        return lease
    if op == "release":
        assert prep["lease"].release() is True
        return None
    if op == "break":
        assert break_lock(name) is True
        return None
    assert purge_locks(idle=0) >= 1
    return None


@pytest.mark.parametrize("alias", ALIASES)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("op", LOCK_OPS)
def test_lock_operation(op: str, context: str, alias: str, setup: Any, grants: list[Lease]):
    name = setup(alias, context)
    expected = expected_lock_outcome(op, context, alias)

    def cell() -> None:
        prep = prepare_lock_op(op, name)
        before = rows()
        # The caller's transaction ends in a rollback: a grant that rode in it would be
        # undone while its lease lives on in Python.
        end = "rollback"
        if expected == "refused":
            with pytest.raises(TransactionNotAllowed):
                in_context(context, end, lambda: run_lock_op(op, name, prep))
            assert rows() == before, "a refused operation changed the lock table"
            held = [lease for lease in prep.values() if isinstance(lease, Lease)]
        else:
            result = in_context(context, end, lambda: run_lock_op(op, name, prep))
            held = [result] if isinstance(result, Lease) else []
            if op == "auto_renew":
                lease = prep["lease"]
                wait_until(lambda: lease.expires_at > prep["expires"], 10, "a renewal")
                assert not lease.lost
            if op == "release":
                assert Lock.objects.get(name=name).owner == ""
            if op == "break":
                assert prep["lease"].release() is False
            if op == "purge":
                assert not Lock.objects.filter(name=name).exists()
                assert Lock.objects.filter(name=f"{name}:top").exists()
        assert_grants_sound(grants, {name}, held)
        for lease in [*held, *(v for v in prep.values() if isinstance(v, Lease))]:
            lease.release()

    run_with_deadline(cell)


# -- fenced writes -----------------------------------------------------------------------


def write_plan(context: str, alias: str) -> str:
    """Where the lease is taken and released: "inside" the caller's context (the lock
    table has its own connection) or "outside" it (the lock alias is the data's own, or
    SQLite, whose one writer the caller's transaction holds)."""
    if context == "autocommit":
        return "inside"
    if alias == "separate" and connections["default"].vendor != "sqlite":
        return "inside"
    return "outside"


def do_write(form: str, lease: Lease, key: int) -> Callable[[], None]:
    """Run fenced write ``form``; return the check that it is stored (after a commit)."""
    token = lease.token
    if form == "save":
        account = Account.objects.get(pk=key)
        account.balance = 5
        account.save(fence=lease)
        return lambda: _stored(Account.objects.filter(pk=key, balance=5), token, 1)
    if form == "fenced_create":
        Account.objects.fenced_create(lease, pk=key, balance=7)
        return lambda: _stored(Account.objects.filter(pk=key, balance=7), token, 1)
    if form == "delete":
        Account.objects.get(pk=key).delete(fence=lease)
        return lambda: _stored(Account.objects.filter(pk=key), token, 0)
    if form == "fenced_delete":
        assert Order.objects.filter(customer_id=key).fenced_delete(lease)[0] == 3
        return lambda: _stored(Order.objects.filter(customer_id=key), token, 0)
    if form == "fenced_update":
        assert Order.objects.filter(customer_id=key, amount=1).fenced_update(
            lease, status="paid"
        ) == 1
        return lambda: _stored(Order.objects.filter(customer_id=key, status="paid"), token, 1)
    assert Order.objects.filter(customer_id=key).fenced_update(lease, status="bulk") == 3
    return lambda: _stored(Order.objects.filter(customer_id=key, status="bulk"), token, 3)


def _stored(rows: Any, token: int, count: int) -> None:
    found = list(rows.values_list("fence_token", flat=True))
    assert len(found) == count, f"{count} rows expected, {len(found)} stored"
    assert all(value == token for value in found)


def prepare_rows(form: str, key: int) -> tuple[str, Callable[[], None]]:
    """Rows the write form works on; returns (lock name, check that they are unchanged)."""
    if form in ("save", "delete"):
        Account.objects.create(pk=key, balance=1)
        return f"account:{key}", lambda: _stored(Account.objects.filter(pk=key, balance=1), 0, 1)
    if form == "fenced_create":
        return f"account:{key}", lambda: _stored(Account.objects.filter(pk=key), 0, 0)
    for amount in (1, 2, 3):
        Order.objects.create(customer_id=key, amount=amount)
    return f"customer:{key}", lambda: _stored(Order.objects.filter(customer_id=key), 0, 3)


def _cells() -> list[tuple[str, str, str, str]]:
    cells = []
    for form, context, alias in itertools.product(WRITES, CONTEXTS, ALIASES):
        cells.append((form, context, alias, "commit"))
        # A rollback of the caller's transaction around the writes (and, with a separate
        # lock alias, around the release deferred to its end).
        if context in ("atomic", "manual"):
            cells.append((form, context, alias, "rollback"))
    return cells


@pytest.mark.parametrize(("form", "context", "alias", "end"), _cells())
def test_fenced_write(
    form: str, context: str, alias: str, end: str, setup: Any, grants: list[Lease]
):
    setup(alias, context)
    key = 10_000 + next(_serial)
    plan = write_plan(context, alias)

    def cell() -> None:
        name, unchanged = prepare_rows(form, key)
        outside = acquire(name, ttl=30) if plan == "outside" else None

        def body() -> tuple[Lease, Callable[[], None]]:
            lease = outside or acquire(name, ttl=30)
            stored = do_write(form, lease, key)
            if outside is None:
                # Released while the caller's transaction still holds the write: deferred
                # to that transaction's end, never a wait for it.
                assert lease.release() is True
            return lease, stored

        lease, stored = in_context(context, end, body)
        if outside is not None:
            assert outside.release() is True
        (stored if end == "commit" else unchanged)()
        # Freed by the commit itself, or moments after a rollback (a helper thread).
        wait_until(lambda: Lock.objects.get(name=name).owner == "", 10, "the release")
        assert_grants_sound(grants, {name}, [])

    run_with_deadline(cell)


# -- the window between a fenced write and the end of the caller's transaction -----------


@pytest.fixture
def window(settings: Any) -> None:
    """A separate lock alias on a server with row locks (SQLite refuses it outright)."""
    if connections["default"].vendor == "sqlite":
        pytest.skip("SQLite: a second connection to the file is refused in any transaction")
    settings.DISTLOCK_DATABASE = "locks"


@pytest.mark.parametrize(
    "operation",
    ["renew", "break", "acquire", "purge"],
)
def test_operations_that_would_wait_for_the_callers_own_writes_refuse(window, operation):
    Account.objects.create(pk=1, balance=0)

    def cell() -> None:
        with transaction.atomic():
            lease = acquire("account:1", ttl=30)
            account = Account.objects.get(pk=1)
            account.balance = 1
            account.save(fence=lease)
            attempt = {
                "renew": lambda: lease.renew(),
                "break": lambda: break_lock("account:1"),
                "acquire": lambda: acquire("account:1", ttl=30, blocking=False),
                "purge": lambda: purge_locks(idle=0),
            }[operation]
            with pytest.raises(TransactionNotAllowed, match="your own open transaction"):
                attempt()
            assert lease.release() is True
        assert Lock.objects.get(name="account:1").owner == ""
        assert Account.objects.get(pk=1).fence_token == lease.token

    run_with_deadline(cell)


def test_auto_renewed_lease_released_inside_the_window_does_not_hang(window):
    """The renewer waits for the caller's row lock too; the deferred release stops it
    without waiting for it, and the lock is free once the transaction commits."""
    Account.objects.create(pk=2, balance=0)

    def cell() -> Lease:
        with transaction.atomic():
            lease = acquire("account:2", ttl=0.3, auto_renew=True)
            account = Account.objects.get(pk=2)
            account.balance = 2
            account.save(fence=lease)
            renewed = lease.expires_at
            # Let the renewer come and wait behind this transaction's row lock.
            wait_until(
                lambda: _waiting_on_a_row_lock(), 5, "the renewer waiting on the lock row"
            )
            assert lease.release() is True
            assert lease.expires_at == renewed
        return lease

    lease = run_with_deadline(cell)
    wait_until(lambda: Lock.objects.get(name="account:2").owner == "", 10, "the release")
    fresh = acquire("account:2", ttl=30, blocking=False)
    assert fresh is not None and fresh.token == lease.token + 1
    fresh.release()


def _waiting_on_a_row_lock() -> bool:
    connection = connections["locks"]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
        else:
            # Not innodb_lock_waits: a locking read of a unique key waits in the optimizer
            # ("Statistics"), where that table does not always list it.
            cursor.execute(
                "SELECT count(*) FROM information_schema.processlist WHERE db = DATABASE() "
                "AND id <> CONNECTION_ID() AND command = 'Query' "
                "AND info LIKE %s",
                ["%distlock_lock%FOR UPDATE%"],
            )
        return cursor.fetchone()[0] > 0


def test_deferred_release_after_a_rollback_frees_the_lock_and_keeps_nothing(window):
    Account.objects.create(pk=3, balance=0)

    def cell() -> Lease:
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            lease = acquire("account:3", ttl=30)
            account = Account.objects.get(pk=3)
            account.balance = 3
            account.save(fence=lease)
            assert lease.release() is True
            1 / 0  # noqa: B018 - the caller's transaction fails after the release
        return lease

    lease = run_with_deadline(cell)
    wait_until(lambda: Lock.objects.get(name="account:3").owner == "", 10, "the release")
    assert Account.objects.get(pk=3).balance == 0
    assert Lock.objects.get(name="account:3").token == lease.token


def test_a_deferred_release_of_a_lease_taken_over_says_it_was_not_held(window):
    """A release deferred to the end of the caller's transaction still says whether the
    lease was held when it was called: False for one that expired and was taken over
    before its fenced write (refused, but its check may hold the lock row, so the release
    is deferred all the same), and the deferred release frees nothing of the new holder's.
    """
    Account.objects.create(pk=4, balance=0)

    def cell() -> tuple[Lease, Lease, bool]:
        stale = expired_lock("account:4")
        taker = acquire("account:4", ttl=30)
        assert taker.token == stale.token + 1
        with transaction.atomic():
            account = Account.objects.get(pk=4)
            account.balance = 4
            with pytest.raises(StaleToken):
                account.save(fence=stale)
            assert uncommitted.holding("account:4", "locks"), (
                "the refused write left no note: the release below would not be deferred"
            )
            held = stale.release()
        return stale, taker, held

    stale, taker, held = run_with_deadline(cell)
    assert held is False, "the deferred release said a lease taken over was still held"
    assert Account.objects.get(pk=4).balance == 0
    row = Lock.objects.get(name="account:4")
    assert (row.owner, row.token) == (taker.owner, taker.token)
    assert taker.release() is True
