"""Fencing at the resource: FencedModel writes are decided by the database.

The process tests replay the seed's story with real OS processes and SIGSTOP: a holder
paused past its lease wakes up still believing it holds the lock, and its write must not
land. In-process tests cover the API edges and show the SQL that decides.
"""

from __future__ import annotations

import os
import queue
import signal
import time

import pytest
from django.db import IntegrityError, connection, connections, models, transaction
from django.db.models import F, OuterRef, Subquery, Value
from django.db.models.expressions import RawSQL
from django.db.models.functions import Concat, Lower
from django.test.utils import CaptureQueriesContext, isolate_apps

from distlock import StaleToken, acquire, checks, signals
from distlock.fencing import FencedModel
from distlock.models import Lock
from distlock.testing import hold_lock, make_stale, take_over
from tests.factories import AccountFactory, OrderFactory, SheetFactory, SlotFactory
from tests.testapp.models import (
    Account,
    Counter,
    Customer,
    Document,
    HighWaterAccount,
    Ledger,
    Order,
    Sheet,
    Shipment,
    Slot,
)

pytestmark = pytest.mark.usefixtures("lock_db")

TTL = 1.0
WORKER = "tests.support.fencing_workers:"


@pytest.fixture
def refusals():
    """Every stale_write_refused signal sent during the test."""
    seen = []

    def receiver(sender, lease, instance_token=None, **kwargs):
        seen.append((sender, lease, instance_token))

    signals.stale_write_refused.connect(receiver)
    yield seen
    signals.stale_write_refused.disconnect(receiver)


def pause_until(deadline: float) -> None:
    """Let a paused process stay paused until ``deadline`` (the scenario's pause length)."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.1))


def assert_silent(child, seconds: float) -> None:
    """The child reports nothing for ``seconds`` (it is blocked, as it should be)."""
    try:
        got = child.events.get(timeout=seconds)
    except queue.Empty:
        return
    raise AssertionError(f"{child.role} should be waiting, but reported {got}")


# -- the canonical story, with real processes ---------------------------------------------


@pytest.mark.processes
def test_paused_holder_cannot_write_after_a_newer_holder_wrote(children, refusals):
    account = AccountFactory(note="initial")
    a = children.start(WORKER + "writer", "testapp.Account", account.pk, TTL)
    lease_a = a.expect("acquired")
    a.send("check")
    assert a.expect("checked")["remaining"] > 0  # A believes it holds the lock
    a.signal(signal.SIGSTOP)
    resume_at = time.monotonic() + 2 * TTL
    b = children.start(WORKER + "writer", "testapp.Account", account.pk, TTL)
    lease_b = b.expect("acquired")
    assert lease_b["token"] == lease_a["token"] + 1
    assert lease_b["acquired_us"] >= lease_a["expires_us"]
    b.send("write", note="B")
    b.expect("wrote")
    pause_until(resume_at)
    a.signal(signal.SIGCONT)
    a.send("write", note="A")
    refused = a.expect("refused")
    assert f"'account:{account.pk}'" in refused["message"]
    assert f"has token {lease_a['token']}" in refused["message"]
    assert f"row's token is {lease_b['token']}" in refused["message"]
    assert refused["lost"] is True
    a.send("release")
    assert a.expect("released")["held"] is False
    account.refresh_from_db()
    assert (account.note, account.balance, account.fence_token) == ("B", 1, lease_b["token"])
    row = Lock.objects.get(name=f"account:{account.pk}")
    assert (row.owner, row.token) == (lease_b["owner"], lease_b["token"])
    assert not row.is_free
    assert refusals == []  # the refusal was in the child; this process saw none
    for child in (a, b):
        child.send("exit")
        assert child.finish() == 0


@pytest.mark.processes
def test_paused_holder_is_refused_even_if_the_new_holder_wrote_nothing(children):
    account = AccountFactory(note="initial")
    a = children.start(WORKER + "writer", "testapp.Account", account.pk, TTL)
    lease_a = a.expect("acquired")
    a.send("check")
    a.expect("checked")
    a.signal(signal.SIGSTOP)
    resume_at = time.monotonic() + 2 * TTL
    b = children.start(WORKER + "writer", "testapp.Account", account.pk, TTL * 30)
    lease_b = b.expect("acquired")
    pause_until(resume_at)
    a.signal(signal.SIGCONT)
    a.send("write", note="A")
    refused = a.expect("refused")
    # The row was never written by B: only the ownership check can refuse A.
    assert f"has token {lease_a['token']}" in refused["message"]
    assert "row's token is 0" in refused["message"]
    assert f"current token {lease_b['token']}" in refused["message"]
    account.refresh_from_db()
    assert (account.note, account.balance, account.fence_token) == ("initial", 0, 0)
    row = Lock.objects.get(name=f"account:{account.pk}")
    assert (row.owner, row.token) == (lease_b["owner"], lease_b["token"])
    for child in (a, b):
        child.send("exit")
        assert child.finish() == 0


@pytest.mark.processes
def test_high_water_mark_alone_lets_that_stale_write_through(children):
    """The documented gap of the high-water mark without the ownership check.

    HighWaterAccount sets fence_check_ownership = False. B holds the lock but has not
    written the row yet, so the row's token is still below A's: A's late write lands.
    Once B writes, A is refused (the high-water mark does stop that).
    """
    account = HighWaterAccount.objects.create(note="initial")
    a = children.start(WORKER + "writer", "testapp.HighWaterAccount", account.pk, TTL)
    lease_a = a.expect("acquired")
    a.signal(signal.SIGSTOP)
    resume_at = time.monotonic() + 2 * TTL
    b = children.start(WORKER + "writer", "testapp.HighWaterAccount", account.pk, TTL * 30)
    lease_b = b.expect("acquired")
    pause_until(resume_at)
    a.signal(signal.SIGCONT)
    a.send("write", note="A late")
    a.expect("wrote")  # accepted: this is the gap
    account.refresh_from_db()
    assert (account.note, account.fence_token) == ("A late", lease_a["token"])
    b.send("write", note="B")
    b.expect("wrote")
    a.send("write", note="A again")
    refused = a.expect("refused")
    assert f"row's token is {lease_b['token']}" in refused["message"]
    account.refresh_from_db()
    assert (account.note, account.fence_token) == ("B", lease_b["token"])
    for child in (a, b):
        child.send("exit")
        assert child.finish() == 0


@pytest.mark.processes
def test_take_over_waits_for_a_paused_writers_commit(children):
    """A is stopped after its ownership check, before its commit, past its lease.

    The check's shared lock on the lock row (SQLite: the write lock) makes B's acquire
    wait, so B's grant comes after A's commit and A's write stands.
    """
    account = AccountFactory(note="initial")
    a = children.start(WORKER + "commit_later", "testapp.Account", account.pk, TTL, "A")
    lease_a = a.expect("acquired")
    a.send("write")
    written = a.expect("written")
    a.signal(signal.SIGSTOP)
    resume_at = time.monotonic() + 2 * TTL
    b = children.start(WORKER + "writer", "testapp.Account", account.pk, TTL * 30)
    # B blocks for the whole pause, although A's lease ran out half-way through it.
    assert_silent(b, 2 * TTL)
    pause_until(resume_at)
    assert Lock.objects.get(name=f"account:{account.pk}").owner == lease_a["owner"]
    a.signal(signal.SIGCONT)
    a.send("commit")
    a.expect("committed")
    lease_b = b.expect("acquired")
    assert lease_b["token"] == lease_a["token"] + 1
    assert lease_b["acquired_us"] > written["last_us"]
    assert lease_b["acquired_us"] > lease_a["expires_us"]
    account.refresh_from_db()
    assert (account.note, account.fence_token) == ("A", lease_a["token"])
    b.send("write", note="B")
    b.expect("wrote")
    account.refresh_from_db()
    assert (account.note, account.fence_token) == ("B", lease_b["token"])
    assert a.finish() == 0
    b.send("exit")
    assert b.finish() == 0


# The 8 processes × 200 increments: measured 18 s (SQLite), 32 s (PostgreSQL),
# 23 s (MariaDB) for this test alone on a shared 2-core machine (each of the 16 pauses
# also blocks the lock for a ttl). DISTLOCK_TEST_FENCE_INCREMENTS sets another count.
PROCESSES, PAUSES, STRESS_TTL = 8, 2, 0.4
INCREMENTS = int(os.environ.get("DISTLOCK_TEST_FENCE_INCREMENTS", "200"))


@pytest.mark.processes
def test_no_lost_update_under_contention_and_pauses(children):
    Counter.objects.create(key="c")
    workers = [
        children.start(
            WORKER + "incrementer", "c", INCREMENTS, STRESS_TTL, PAUSES, 1000 + number
        )
        for number in range(PROCESSES)
    ]
    for worker in workers:
        worker.expect("ready", timeout=60)
    for worker in workers:
        worker.send("go")
    results = [worker.expect("done", timeout=240) for worker in workers]
    acked = sorted(value for result in results for value in result["acked"])
    refused = sum(result["refused"] for result in results)
    counter = Counter.objects.get(key="c")
    # Every acknowledged write is in the row, once: the values written are exactly 1..N.
    assert counter.value == len(acked)
    assert acked == list(range(1, len(acked) + 1))
    # Each pause outlived its lease, so each of those writes was refused (not vacuous).
    assert refused >= PROCESSES * PAUSES
    assert len(acked) + refused == PROCESSES * INCREMENTS
    assert len(acked) >= PROCESSES * INCREMENTS // 4  # the lock did its job most of the time
    assert counter.fence_token == max(t for result in results for t in result["tokens"])
    for worker in workers:
        assert worker.finish() == 0


# -- the API, in one process ---------------------------------------------------------------


def test_fenced_save_writes_and_records_the_token():
    account = AccountFactory()
    lease = acquire(f"account:{account.pk}", ttl=30)
    account.balance = 10
    account.save(fence=lease)
    assert account.fence_token == lease.token
    account.refresh_from_db()
    assert (account.balance, account.fence_token) == (10, lease.token)


def test_equal_token_is_allowed_for_several_writes():
    account = AccountFactory()
    lease = acquire(f"account:{account.pk}", ttl=30)
    for balance in (1, 2, 3):
        account.balance = balance
        account.save(fence=lease)
    assert Account.objects.filter(pk=account.pk).fenced_update(lease, note="x") == 1
    account.refresh_from_db()
    assert (account.balance, account.note, account.fence_token) == (3, "x", lease.token)
    assert not lease.lost


def test_stale_lease_is_refused_and_nothing_is_written(refusals):
    account = AccountFactory(balance=5)
    old = acquire(f"account:{account.pk}", ttl=30)
    new = take_over(old)
    Account.objects.filter(pk=account.pk).fenced_update(new, balance=F("balance") + 1)
    account.balance = 100
    with pytest.raises(StaleToken, match=rf"'account:{account.pk}'.*token {old.token}"):
        account.save(fence=old)
    assert account.fence_token == 0  # the instance is left as it was
    row = Account.objects.get(pk=account.pk)
    assert (row.balance, row.fence_token) == (6, new.token)
    assert old.lost
    assert refusals == [(Account, old, new.token)]
    with pytest.raises(StaleToken):
        Account.objects.filter(pk=account.pk).fenced_update(old, balance=0)
    with pytest.raises(StaleToken):
        row.delete(fence=old)
    assert Account.objects.get(pk=account.pk).balance == 6


def test_refusal_is_recorded_in_the_audit_history(settings):
    from distlock.models import LockEvent

    settings.DISTLOCK_AUDIT = True
    account = AccountFactory()
    lease = acquire(f"account:{account.pk}", ttl=30)
    make_stale(lease)
    with pytest.raises(StaleToken):
        account.save(fence=lease)
    kinds = set(
        LockEvent.objects.filter(name=f"account:{account.pk}", token=lease.token)
        .values_list("kind", flat=True)
    )
    assert {"stale_write", "lost"} <= kinds


def test_ownership_check_refuses_an_expired_lease_on_an_untouched_row():
    account = AccountFactory(note="initial")
    lease = acquire(f"account:{account.pk}", ttl=30)
    make_stale(lease)  # nobody has taken the lock over; the row is untouched
    account.note = "late"
    with pytest.raises(StaleToken, match="expired by the database clock"):
        account.save(fence=lease)
    assert Account.objects.get(pk=account.pk).note == "initial"
    orders = acquire("customer:5", ttl=30)
    make_stale(orders)
    with pytest.raises(StaleToken, match="row's token is none"):
        Order.objects.fenced_create(orders, customer_id=5)
    assert not Order.objects.exists()


def test_released_or_broken_lease_is_refused():
    account = AccountFactory()
    lease = acquire(f"account:{account.pk}", ttl=30)
    lease.release()
    with pytest.raises(StaleToken, match="released or broken"):
        account.save(fence=lease)


def test_lease_of_another_lock_is_refused_with_value_error():
    first, second = AccountFactory(), AccountFactory()
    lease = acquire(f"account:{second.pk}", ttl=30)
    first.balance = 99
    with pytest.raises(ValueError, match=f"guarded by lock 'account:{first.pk}'"):
        first.save(fence=lease)
    with pytest.raises(ValueError):
        first.delete(fence=lease)
    with pytest.raises(ValueError):
        Account.objects.filter(pk=first.pk).fenced_update(lease, balance=99)
    with pytest.raises(ValueError):
        Ledger.objects.fenced_create(lease, entry="x")
    assert Account.objects.get(pk=first.pk).balance == 0
    assert not lease.lost  # a programming error, not a stale lease


def test_bulk_fenced_update_counts_rows_and_is_all_or_nothing():
    OrderFactory.create_batch(3, customer_id=7)
    OrderFactory.create_batch(2, customer_id=8)
    lease = acquire("customer:7", ttl=30)
    orders = Order.objects.filter(customer_id=7)
    assert orders.fenced_update(lease, status="paid", amount=F("amount") + 5) == 3
    assert Order.objects.filter(customer_id=77).fenced_update(lease, status="x") == 0
    assert list(orders.values_list("status", "fence_token").distinct()) == [
        ("paid", lease.token)
    ]
    # Rows of another customer in the queryset: refused, none written.
    with pytest.raises(ValueError, match="guarded by another lock"):
        Order.objects.all().fenced_update(lease, status="shipped")
    assert not Order.objects.filter(status="shipped").exists()
    # One row carries a newer token (as if a later grant wrote it): refused, none written.
    newest = orders.first()
    Order.objects.filter(pk=newest.pk).update(amount=1)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {Order._meta.db_table} SET fence_token = %s WHERE id = %s",
            [lease.token + 1, newest.pk],
        )
    with pytest.raises(StaleToken, match=rf"row's token is {lease.token + 1}"):
        orders.fenced_update(lease, status="shipped")
    assert not Order.objects.filter(status="shipped").exists()


def test_one_statement_fenced_update_guards_every_row_unless_one_is_pinned():
    """All or nothing in one statement: a filter that pins a unique column (pk=...) matches
    one row at most, so the statement needs no guard against skipped rows; any other
    filter carries NOT EXISTS (a skipped row), and is still refused as a whole."""
    first, second = AccountFactory(balance=3), AccountFactory(balance=4)
    lease = acquire(f"account:{first.pk}", ttl=30)

    def sql_of(rows, **changes):
        with CaptureQueriesContext(connection) as captured:
            rows.fenced_update(lease, **changes)
        return captured[0]["sql"]

    pinned = sql_of(Account.objects.filter(pk=first.pk, balance=first.balance), note="a")
    assert "NOT EXISTS" not in pinned
    # The lock name's condition is the filter's.
    assert pinned.count(f"{connection.ops.quote_name('id')} = {first.pk}") == 1
    either = Account.objects.filter(pk=first.pk) | Account.objects.filter(pk=second.pk)
    with pytest.raises(ValueError, match="guarded by another lock"):
        either.fenced_update(lease, note="b")
    assert "NOT EXISTS" in sql_of(Account.objects.filter(pk__in=[first.pk]), note="c")
    assert "NOT EXISTS" in sql_of(Account.objects.filter(balance=first.balance), note="c")
    assert list(Account.objects.order_by("pk").values_list("note", flat=True)) == ["c", ""]
    # A pinned row holding a newer token: refused, not written.
    Account.objects.filter(pk=first.pk).update(balance=5)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {Account._meta.db_table} SET fence_token = %s WHERE id = %s",
            [lease.token + 1, first.pk],
        )
    with pytest.raises(StaleToken):
        Account.objects.filter(pk=first.pk).fenced_update(lease, balance=F("balance") + 1)
    assert Account.objects.get(pk=first.pk).balance == 5


def test_bulk_writes_match_lock_names_exactly():
    """The row's lock name must be the lease's, character for character, on every backend:
    "customer:07" is not customer 7's lock, "counter:abc" is not counter "Abc"'s."""
    OrderFactory.create_batch(2, customer_id=7)
    Counter.objects.create(key="Abc")
    for name, rows in [
        ("customer:07", Order.objects.filter(customer_id=7)),
        ("customer:+7", Order.objects.filter(customer_id=7)),
        ("customer:--7", Order.objects.filter(customer_id=7)),
        ("customer:\u0667", Order.objects.filter(customer_id=7)),  # ARABIC-INDIC SEVEN
        ("customer:7 ", Order.objects.filter(customer_id=7)),
        ("counter:abc", Counter.objects.filter(key="Abc")),
        ("counter:Abc ", Counter.objects.filter(key="Abc")),
    ]:
        lease = acquire(name, ttl=30)
        with pytest.raises(ValueError, match="guarded by another lock"):
            rows.fenced_update(lease, **({"status": "x"} if rows.model is Order else {}))
        assert lease.release() is True
    lease = acquire("counter:Abc", ttl=30)
    assert Counter.objects.filter(key="Abc").fenced_update(lease, value=F("value") + 1) == 1
    lease = acquire("customer:7", ttl=30)
    assert Order.objects.filter(customer_id=7).fenced_update(lease, status="x") == 2
    assert not Order.objects.exclude(status="x").exists()


def test_bulk_fenced_update_of_no_rows_still_requires_a_current_lease():
    """Zero rows is a count for a current lease and a refusal for a stale one (both paths)."""
    lease = acquire("customer:5", ttl=30)
    assert Order.objects.filter(customer_id=5).fenced_update(lease, status="x") == 0
    with transaction.atomic():
        assert Order.objects.filter(customer_id=5).fenced_update(lease, status="x") == 0
    make_stale(lease)
    with pytest.raises(StaleToken, match="expired"):
        Order.objects.filter(customer_id=5).fenced_update(lease, status="x")
    with pytest.raises(StaleToken, match="expired"), transaction.atomic():
        Order.objects.filter(customer_id=5).fenced_update(lease, status="x")


def test_bulk_fenced_update_refuses_joins_and_the_token_column():
    lease = acquire("customer:1", ttl=30)
    with pytest.raises(ValueError, match="sets fence_token itself"):
        Order.objects.filter(customer_id=1).fenced_update(lease, fence_token=1)
    with pytest.raises(ValueError, match="fence_token is written only"):
        Order.objects.filter(customer_id=1).update(fence_token=1)
    with pytest.raises(TypeError, match="Lease"):
        Order.objects.filter(customer_id=1).fenced_update("customer:1", status="x")


def test_bulk_fenced_writes_refuse_a_filter_through_a_join():
    """One join is refused as much as several: on MariaDB and MySQL, Django would read the
    ids first and update them without the fence's condition."""
    customer = Customer.objects.create(name="c")
    lease = acquire(f"customer:{customer.pk}", ttl=30)
    Shipment.objects.fenced_create(lease, customer=customer)
    through_join = Shipment.objects.filter(customer__name="c")
    with pytest.raises(ValueError, match="no joins"):
        through_join.fenced_update(lease, status="sent")
    with pytest.raises(ValueError, match="no joins"):
        through_join.fenced_delete(lease)
    assert list(Shipment.objects.values_list("status", flat=True)) == ["new"]
    own = Shipment.objects.filter(customer_id=customer.pk)
    assert own.fenced_update(lease, status="sent") == 1


@pytest.mark.django_db(transaction=True, databases=["default", "locks"])
def test_fenced_delete_deletes_only_the_rows_it_claimed():
    """A row another connection inserts between the claim and the delete (in READ
    COMMITTED the delete sees it) was not fenced: it stays."""
    if connections["default"].vendor == "sqlite":
        pytest.skip("one writer per file: no row can be inserted inside the delete's transaction")
    ledger = acquire("ledger", ttl=30)
    Ledger.objects.fenced_create(ledger, entry="c")

    def insert_after_the_claim(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if sql.lstrip().upper().startswith("UPDATE") and "ledger" in sql.lower():
            Ledger.objects.using("locks").create(entry="c")
        return result

    with connections["default"].execute_wrapper(insert_after_the_claim):
        count, _ = Ledger.objects.filter(entry="c").fenced_delete(ledger)
    assert count == 1
    assert list(Ledger.objects.values_list("entry", "fence_token")) == [("c", 0)]


def test_fenced_delete_and_fenced_create():
    lease = acquire("account:4242", ttl=30)
    created = Account.objects.fenced_create(lease, pk=4242, balance=3)
    assert created.fence_token == lease.token
    assert Account.objects.get(pk=4242).fence_token == lease.token
    created.delete(fence=lease)
    assert not Account.objects.filter(pk=4242).exists()
    ledger = acquire("ledger", ttl=30)
    Ledger.objects.fenced_create(ledger, entry="a")
    Ledger.objects.fenced_create(ledger, entry="b")
    assert Ledger.objects.fenced_update(ledger, entry="c") == 2
    count, _ = Ledger.objects.filter(entry="c").fenced_delete(ledger)
    assert count == 2


def test_lock_name_is_spelled_from_the_values_as_stored():
    """"07" in an IntegerField is stored as 7: the new row is customer 7's, not "customer:07"'s
    (a lease may be taken for any string), in Python as in SQL."""
    odd = acquire("customer:07", ttl=30)
    with pytest.raises(ValueError, match="guarded by lock 'customer:7'"):
        Order.objects.fenced_create(odd, customer_id="07")
    assert not Order.objects.exists()
    assert not odd.lost
    lease = acquire("customer:7", ttl=30)
    order = Order.objects.fenced_create(lease, customer_id="07", amount=1)
    assert order.get_fence_name() == "customer:7"
    assert Order.objects.filter(customer_id=7).fenced_update(lease, amount=2) == 1


def test_save_refuses_an_expression_in_a_field_of_the_lock_name_before_any_sql():
    """Its new name is known only in SQL, after the write: assign a value or use
    fenced_update(), which checks the name of such a change in its WHERE."""
    order = OrderFactory(customer_id=7, amount=1)
    lease = acquire("customer:7", ttl=30)
    order.customer_id = F("customer_id") + 1
    with CaptureQueriesContext(connection) as captured, pytest.raises(
        ValueError, match="'customer_id' is set to an expression"
    ):
        order.save(fence=lease)
    assert captured.captured_queries == []
    order.customer_id = 7
    order.amount = F("amount") + 2  # other fields may be expressions, as in save()
    order.save(fence=lease)
    assert Order.objects.values_list("customer_id", "amount", "fence_token").get() == (
        7, 3, lease.token
    )


def test_a_row_with_none_in_its_lock_name_has_no_name_and_is_refused():
    """str.format would name it "customer:None", a name a lease can be taken for; SQL
    gives such a row no name (E012 keeps NULL out of the columns of a name)."""
    lease = acquire("customer:None", ttl=30)
    with pytest.raises(ValueError, match="no lock name: its field 'customer_id' is None"):
        Order(customer_id=None).get_fence_name()
    with pytest.raises(ValueError, match="no lock name"):
        Order.objects.fenced_create(lease, customer_id=None)
    assert not Order.objects.exists()
    assert not lease.lost


def test_new_row_whose_name_needs_its_pk_is_checked_after_insert():
    # "account:{pk}" with an automatic pk: the name is known only after the INSERT.
    lease = acquire("account:not-a-number", ttl=30)
    account = Account(balance=1)
    with pytest.raises(ValueError, match="guarded by lock 'account:"):
        account.save(fence=lease)
    assert account.pk is None and account._state.adding
    assert not Account.objects.exists()


def test_lock_name_from_a_method_with_its_sql_form():
    document = Document.objects.create(folder="Reports")
    lease = acquire("folder/reports", ttl=30)
    assert Document.objects.filter(folder="Reports").fenced_update(lease, title="t") == 1
    # Changes to the columns its SQL form reads are checked against that form.
    with pytest.raises(ValueError, match="would be guarded by another lock"):
        Document.objects.filter(folder="Reports").fenced_update(lease, folder="Plans")
    assert Document.objects.filter(pk=document.pk).fenced_update(lease, folder="REPORTS") == 1
    document.refresh_from_db()
    assert document.folder == "REPORTS"
    document.title = "u"
    document.save(fence=lease)
    document.delete(fence=lease)
    assert not Document.objects.exists()


def test_multi_field_templates_write_on_every_backend():
    """Two text columns, or an integer and a text column, in one lock name.

    The SQL form is a Concat of text literals and columns; on PostgreSQL it once mixed
    TextField and CharField and every fenced write raised FieldError.
    """
    sheet = SheetFactory(book="b", tab="t")
    other = SheetFactory(book="b", tab="u")
    slot = SlotFactory(day=3, label="am")
    sheets = acquire("sheet:b:t", ttl=30)
    slots = acquire("slot:3/am", ttl=30)
    sheet.body = "saved"
    sheet.save(fence=sheets)
    slot.booked = 1
    slot.save(fence=slots)
    assert Sheet.objects.filter(book="b", tab="t").fenced_update(sheets, body="bulk") == 1
    assert Slot.objects.filter(day=3).fenced_update(slots, booked=F("booked") + 1) == 1
    with pytest.raises(ValueError, match="guarded by another lock"):
        Sheet.objects.filter(book="b").fenced_update(sheets, body="both")
    assert Sheet.objects.fenced_create(sheets, book="b", tab="t").fence_token == sheets.token
    assert Slot.objects.fenced_create(slots, day="3", label="am").fence_token == slots.token
    assert list(Sheet.objects.order_by("pk").values_list("body", flat=True)) == [
        "bulk", "", "",
    ]
    assert Slot.objects.get(pk=slot.pk).booked == 2
    assert Sheet.objects.filter(tab="t").fenced_delete(sheets)[0] == 2
    slot.delete(fence=slots)
    assert list(Sheet.objects.values_list("pk", flat=True)) == [other.pk]
    assert list(Slot.objects.values_list("day", "label")) == [(3, "am")]
    assert not sheets.lost and not slots.lost


def test_python_and_sql_lock_names_agree_for_multi_field_templates():
    """get_fence_name() and get_fence_name_expression() name every row alike, also where
    two rows share a name ("sheet:a:b:c" is book "a", tab "b:c" and book "a:b", tab "c")."""
    rows = [
        SheetFactory(book="a", tab="b:c"), SheetFactory(book="a:b", tab="c"),
        SheetFactory(book="", tab="x"), SheetFactory(book="É ", tab="e\u0301"),
        SlotFactory(day=-12, label="1"), SlotFactory(day=0, label=""),
    ]
    for model in (Sheet, Slot):
        in_sql = dict(
            model.objects.annotate(lock=model.get_fence_name_expression())
            .values_list("pk", "lock")
        )
        assert in_sql == {
            row.pk: row.get_fence_name() for row in rows if isinstance(row, model)
        }
    assert rows[0].get_fence_name() == rows[1].get_fence_name() == "sheet:a:b:c"
    lease = acquire("sheet:a:b:c", ttl=30)
    assert Sheet.objects.filter(pk__in=[rows[0].pk, rows[1].pk]).fenced_update(
        lease, body="one lock"
    ) == 2


def test_fenced_write_joins_the_callers_transaction():
    account, other = AccountFactory(), AccountFactory()
    lease = acquire(f"account:{account.pk}", ttl=30)
    stale = acquire(f"account:{other.pk}", ttl=30)
    make_stale(stale)
    with transaction.atomic():
        account.balance = 7
        account.save(fence=lease)
        other.note = "late"
        with pytest.raises(StaleToken):
            other.save(fence=stale)  # rolled back to its savepoint; the block goes on
        Account.objects.filter(pk=account.pk).fenced_update(lease, note="in atomic")
    account.refresh_from_db()
    assert (account.balance, account.note) == (7, "in atomic")
    assert Account.objects.get(pk=other.pk).note == ""
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        account.balance = 8
        account.save(fence=lease)
        1 / 0  # noqa: B018 - the caller's rollback takes the fenced write with it
    assert Account.objects.get(pk=account.pk).balance == 7


def test_plain_writes_are_allowed_and_never_lower_the_token():
    account = AccountFactory()
    before = Account.objects.get(pk=account.pk)  # fence_token 0 in memory
    lease = acquire(f"account:{account.pk}", ttl=30)
    account.save(fence=lease)
    before.note = "admin edit"
    before.save()  # no fence: allowed (admin, shell, data migrations)
    row = Account.objects.get(pk=account.pk)
    assert (row.note, row.fence_token) == ("admin edit", lease.token)
    assert Account.objects.filter(pk=account.pk).update(balance=3) == 1
    with pytest.raises(ValueError, match="fence_token is written only"):
        Account.objects.bulk_update([row], ["fence_token"])
    row.delete()
    assert not Account.objects.filter(pk=account.pk).exists()


def test_no_manager_or_bulk_path_writes_the_token():
    """update(), bulk_update(), an upsert by bulk_create() and update_or_create() refuse
    fence_token on the default manager and on _base_manager (Django's own, for related
    objects and refresh_from_db(), which FencedModel makes its fenced default manager)."""
    account = AccountFactory(balance=1)
    lease = acquire(f"account:{account.pk}", ttl=30)
    account.save(fence=lease)
    assert Account._base_manager.name == "objects"
    upsert = {"update_conflicts": True}
    if connection.features.supports_update_conflicts_with_target:
        upsert["unique_fields"] = ["id"]
    copy = Account(pk=account.pk, balance=5, fence_token=0)
    before = rows_of(Account)
    for manager in (Account.objects, Account._base_manager):
        with CaptureQueriesContext(connection) as captured:
            with pytest.raises(ValueError, match="fence_token is written only"):
                manager.update(fence_token=0)
            with pytest.raises(ValueError, match="fence_token is written only"):
                manager.filter(pk=account.pk).update(fence_token=F("fence_token") - 1)
            with pytest.raises(ValueError, match="fence_token is written only"):
                manager.bulk_update([copy], ["balance", "fence_token"])
            with pytest.raises(ValueError, match="fence_token is written only"):
                manager.bulk_create([copy], update_fields=["balance", "fence_token"], **upsert)
            with pytest.raises(ValueError, match="fence_token is written only"):
                manager.update_or_create(pk=account.pk, defaults={"fence_token": 0})
            with pytest.raises(ValueError, match="fence_token is written only"):
                manager.update_or_create(pk=account.pk + 1, defaults={"fence_token": 0})
        assert captured.captured_queries == []
    assert rows_of(Account) == before
    # The same calls without the token stay plain, unfenced writes.
    Account._base_manager.bulk_create([copy], update_fields=["balance"], **upsert)
    Account._base_manager.update_or_create(pk=account.pk, defaults={"note": "upsert"})
    assert Account.objects.values_list("balance", "note", "fence_token").get() == (
        5, "upsert", lease.token
    )


def test_moving_a_row_to_another_locks_name_is_refused():
    order = OrderFactory(customer_id=1)
    lease = acquire("customer:2", ttl=30)
    order.customer_id = 2  # the instance now names lock customer:2, the stored row customer:1
    with pytest.raises(ValueError, match="as stored is guarded by another lock"):
        order.save(fence=lease)
    assert Order.objects.get(pk=order.pk).customer_id == 1
    assert not lease.lost


def rows_of(model) -> list[tuple]:
    """Every row of ``model`` with every column, in pk order: "nothing changed" checks."""
    return list(model.objects.order_by("pk").values_list())


def test_fenced_update_cannot_move_rows_to_another_lock():
    """customer:7's lease must not give its rows customer 8's name: customer:8's holder
    would find its rows changed (and its own next write refused) though it held the lock.

    A value is compared in Python before any SQL; an expression in the UPDATE's WHERE,
    on the row as it was, so customer_id = F("customer_id") + 0 passes and + 1 does not.
    """
    eight = acquire("customer:8", ttl=30)  # older token than seven's
    seven = acquire("customer:7", ttl=30)
    OrderFactory.create_batch(2, customer_id=7, amount=1)
    OrderFactory(customer_id=8, amount=1)
    orders = Order.objects.filter(customer_id=7)
    before = rows_of(Order)
    with CaptureQueriesContext(connection) as captured, pytest.raises(
        ValueError, match="would give them lock 'customer:8'"
    ):
        orders.fenced_update(seven, customer_id=8)
    assert captured.captured_queries == []
    with pytest.raises(ValueError, match="would be guarded by another lock"):
        orders.fenced_update(seven, customer_id=F("customer_id") + 1, status="moved")
    with pytest.raises(ValueError, match="columns this update also changes"):
        orders.fenced_update(seven, customer_id=F("amount") + 6, amount=2)
    same = Order.objects.filter(pk=OuterRef("pk")).values("customer_id")[:1]
    for unknowable in (Subquery(same), RawSQL("customer_id", [])):
        with pytest.raises(ValueError, match="subquery or raw SQL"):
            orders.fenced_update(seven, customer_id=unknowable)
    assert rows_of(Order) == before
    assert orders.fenced_update(seven, customer_id=F("customer_id") + 0) == 2
    assert orders.fenced_update(seven, customer_id="7", status="same") == 2
    assert orders.fenced_update(seven, customer_id=F("amount") + 6) == 2  # 1 + 6: still 7
    assert Order.objects.filter(customer_id=8).fenced_update(eight, status="mine") == 1
    assert not seven.lost and not eight.lost
    assert sorted(Order.objects.values_list("customer_id", "status")) == [
        (7, "same"), (7, "same"), (8, "mine"),
    ]


def test_fenced_update_cannot_change_the_pk_in_a_lock_name():
    account = AccountFactory()
    lease = acquire(f"account:{account.pk}", ttl=30)
    rows = Account.objects.filter(pk=account.pk)
    with pytest.raises(ValueError, match=f"would give them lock 'account:{account.pk + 100}'"):
        rows.fenced_update(lease, id=account.pk + 100)
    with pytest.raises(ValueError, match="guarded by another lock"):
        rows.fenced_update(lease, id=F("id") + 100)
    assert rows.fenced_update(lease, id=account.pk, balance=1) == 1
    assert list(Account.objects.values_list("pk", "balance")) == [(account.pk, 1)]


def test_fenced_update_of_one_field_of_a_multi_field_name_is_checked_in_sql():
    """With "sheet:{book}:{tab}" the new name mixes the new book and each row's tab."""
    SheetFactory(book="a", tab="b")
    lease = acquire("sheet:a:b", ttl=30)
    rows = Sheet.objects.filter(tab="b")
    before = rows_of(Sheet)
    for changes in (
        {"book": "x"}, {"book": Concat(F("book"), Value("x"))}, {"tab": F("book")},
    ):
        with pytest.raises(ValueError, match="would be guarded by another lock"):
            rows.fenced_update(lease, **changes)
    with pytest.raises(ValueError, match="would give them lock 'sheet:a:b:'"):
        rows.fenced_update(lease, book="a:b", tab="")
    assert rows_of(Sheet) == before
    assert rows.fenced_update(lease, book="a", body="1") == 1
    assert rows.fenced_update(lease, book=Lower("book"), body="2") == 1
    assert Sheet.objects.values_list("book", "tab", "body").get() == ("a", "b", "2")
    assert not lease.lost


def test_fenced_save_cannot_move_a_row_with_some_fields_of_its_name():
    """The instance's name is the lease's, the stored row's too, yet writing only
    ``book`` would leave the row named "sheet:x:y:y:z": refused by the UPDATE's WHERE."""
    sheet = SheetFactory(book="x", tab="y:z")
    lease = acquire("sheet:x:y:z", ttl=30)
    sheet.book, sheet.tab = "x:y", "z"
    assert sheet.get_fence_name() == lease.name
    before = rows_of(Sheet)
    with pytest.raises(ValueError, match="would be guarded by another lock"):
        sheet.save(fence=lease, update_fields=["book"])
    assert rows_of(Sheet) == before
    deferred = Sheet.objects.only("book").get()  # saving writes only the loaded fields
    deferred.book = "x:y"  # its name reads the stored tab: "sheet:x:y:y:z"
    with pytest.raises(ValueError, match="guarded by lock 'sheet:x:y:y:z'"):
        deferred.save(fence=lease)
    assert rows_of(Sheet) == before
    sheet.save(fence=lease)  # every field: the row keeps its lock name
    assert Sheet.objects.values_list("book", "tab").get() == ("x:y", "z")
    assert not lease.lost


def test_fenced_save_with_a_changed_pk_writes_that_row_and_never_copies():
    """Django's save() inserts a copy when no row has the new pk; a fenced save is an
    UPDATE of the row with that pk (refused if it is another lock's, StaleToken if none)."""
    order, other = OrderFactory(customer_id=7), OrderFactory(customer_id=8)
    lease = acquire("customer:7", ttl=30)
    before = rows_of(Order)
    order.pk = other.pk
    with pytest.raises(ValueError, match="as stored is guarded by another lock"):
        order.save(fence=lease)
    order.pk = other.pk + 1000
    with pytest.raises(StaleToken, match="the row no longer exists"):
        order.save(fence=lease)
    assert rows_of(Order) == before
    account = AccountFactory()
    moved = acquire(f"account:{account.pk + 1000}", ttl=30)
    account.pk += 1000
    with pytest.raises(StaleToken, match="the row no longer exists"):
        account.save(fence=moved)
    assert list(Account.objects.values_list("pk", flat=True)) == [account.pk - 1000]


def test_fenced_delete_and_create_refuse_rows_of_another_lock():
    order = OrderFactory(customer_id=7)
    OrderFactory(customer_id=8)
    seven, eight = acquire("customer:7", ttl=30), acquire("customer:8", ttl=30)
    before = rows_of(Order)
    order.customer_id = 8
    with pytest.raises(ValueError, match="guarded by lock 'customer:8'"):
        order.delete(fence=seven)
    with pytest.raises(ValueError, match="as stored is guarded by another lock"):
        order.delete(fence=eight)
    with pytest.raises(ValueError, match="guarded by another lock"):
        Order.objects.all().fenced_delete(seven)
    with pytest.raises(ValueError, match="guarded by lock 'customer:8'"):
        Order.objects.fenced_create(seven, customer_id=8)
    with pytest.raises(ValueError, match="guarded by lock 'sheet:a:b'"):
        Sheet.objects.fenced_create(acquire("sheet:a:b:", ttl=30), book="a", tab="b")
    assert rows_of(Order) == before
    assert not Sheet.objects.exists()
    assert not seven.lost and not eight.lost


@pytest.mark.django_db(transaction=True, databases=["default", "locks"])
def test_lock_on_another_alias_of_the_same_database_is_still_checked(settings):
    settings.DISTLOCK_DATABASE = "locks"
    account = AccountFactory()
    lease = acquire(f"account:{account.pk}", ttl=30)
    assert lease.using == "locks"
    account.save(fence=lease)
    make_stale(lease)
    with pytest.raises(StaleToken, match="expired"):
        account.save(fence=lease)
    connections["locks"].close()


def _statements(captured) -> list[str]:
    return [
        q["sql"] for q in captured
        if not q["sql"].upper().startswith(("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE"))
    ]


def _function_body(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT prosrc FROM pg_proc WHERE proname = %s", [name])
        return cursor.fetchone()[0]


def test_captured_sql_is_a_locking_check_then_one_conditional_write():
    """No read of the data row decides anything: the UPDATE's WHERE does.

    On PostgreSQL, SQLite and MariaDB (in autocommit) save and fenced_update are a single
    statement, the locking check folded into the UPDATE's WHERE; elsewhere the check is a
    statement of its own in the write's transaction.
    """
    account = AccountFactory()
    pk = account.pk
    lease = acquire(f"account:{pk}", ttl=30)
    vendor = connection.vendor
    share = {"postgresql": "FOR SHARE", "mysql": "LOCK IN SHARE MODE", "sqlite": ""}[vendor]
    clock = {"postgresql": "clock_timestamp()", "mysql": "SYSDATE(6)", "sqlite": "julianday"}
    table = Account._meta.db_table
    writes = {
        "save": lambda: account.save(fence=lease),
        "fenced_update": lambda: Account.objects.filter(pk=pk).fenced_update(
            lease, balance=F("balance") + 1
        ),
        "delete": lambda: account.delete(fence=lease),
        "create": lambda: Account.objects.fenced_create(lease, pk=pk),
    }
    for what, write in writes.items():
        with CaptureQueriesContext(connection) as captured:
            write()
        if vendor == "postgresql" and what in ("save", "fenced_update"):
            assert len(captured) == 1, (what, [q["sql"] for q in captured])
            (update,) = _statements(captured)
            call = update.split("(SELECT distlock_holds(", 1)[1].split(")", 1)[0]
            assert call == f"'{lease.name}', '{lease.owner}', {lease.token}::bigint", what
            check = _function_body("distlock_holds")
            assert "FROM distlock_lock" in check and share in check, what
            assert "p_owner" in check and "l.token = p_token" in check, what
            assert "l.expires_us > CAST(EXTRACT(EPOCH FROM clock_timestamp())" in check, what
        elif vendor == "sqlite" and what in ("save", "fenced_update"):
            # One statement: its write lock, taken as it starts, covers the check in it.
            assert len(captured) == 1, (what, [q["sql"] for q in captured])
            (update,) = _statements(captured)
            check = update.split("EXISTS (SELECT 1 FROM distlock_lock", 1)[1]
            assert lease.owner in check and f"token = {lease.token}" in check, what
        elif vendor == "mysql" and what in ("save", "fenced_update"):
            # MariaDB: the check is an EXISTS sub-select of the UPDATE, a locking read.
            assert len(captured) == 1, (what, [q["sql"] for q in captured])
            (update,) = _statements(captured)
            check = update.split("EXISTS (SELECT 1 FROM distlock_lock", 1)[1]
            check = check.split(f"{share})", 1)[0] + share
            assert f"owner = CAST('{lease.owner}' AS BINARY)" in check, what
            assert f"token = {lease.token}" in check, what
        else:
            check, update, *rest = _statements(captured)
            assert "distlock_lock" in check and check.rstrip().endswith(share), what
            assert lease.owner in check and f"token = {lease.token}" in check, what
        assert clock[vendor] in check and "expires_us >" in check, what
        if what == "create":
            assert update.startswith("INSERT") and table in update, what
            continue
        assert update.startswith("UPDATE") and table in update, what
        where = update.split("WHERE", 1)[1]
        assert "fence_token" in where and f"<= {lease.token}" in where, what
        assert f"= {lease.token}" in update.split("WHERE", 1)[0], what  # SET fence_token


@pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="the trigger is PostgreSQL-only"
)
def test_postgresql_trigger_refuses_lowering_the_token_by_raw_sql():
    account = AccountFactory()
    lease = acquire(f"account:{account.pk}", ttl=30)
    account.save(fence=lease)
    with pytest.raises(IntegrityError, match="would lower"), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {Account._meta.db_table} SET fence_token = 0 WHERE id = %s", [account.pk]
        )
    assert Account.objects.get(pk=account.pk).fence_token == lease.token


@pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="the trigger is PostgreSQL-only"
)
def test_postgresql_trigger_operation_runs_backwards_and_forwards():
    from django.db.migrations.loader import MigrationLoader

    from distlock.fencing.operations import RefuseLowerFenceToken

    account = AccountFactory()
    lease = acquire(f"account:{account.pk}", ttl=30)
    account.save(fence=lease)
    state = MigrationLoader(connection).project_state(("testapp", "0002_fence_triggers"))
    operation = RefuseLowerFenceToken("Account")
    lower = f"UPDATE {Account._meta.db_table} SET fence_token = 0 WHERE id = %s"
    try:
        with connection.schema_editor() as editor:
            operation.database_backwards("testapp", editor, state, state)
        with connection.cursor() as cursor:
            cursor.execute(lower, [account.pk])  # no trigger: raw SQL may lower it
    finally:
        with connection.schema_editor() as editor:
            operation.database_forwards("testapp", editor, state, state)
    assert Account.objects.get(pk=account.pk).fence_token == 0
    with pytest.raises(IntegrityError), connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {Account._meta.db_table} SET fence_token = -1 WHERE id = %s", [account.pk]
        )
    assert operation.deconstruct() == (
        "distlock.fencing.operations.RefuseLowerFenceToken", ["Account"], {}
    )


# -- testing helpers and checks -------------------------------------------------------------


def test_hold_lock_makes_the_lock_busy_for_the_code_under_test():
    with hold_lock("report:1", ttl=30) as other:
        assert acquire("report:1", ttl=30, blocking=False) is None
        assert Lock.objects.get(name="report:1").owner == other.owner
    assert Lock.objects.get(name="report:1").is_free
    with (
        hold_lock("report:1"),
        pytest.raises(RuntimeError, match="already held"),
        hold_lock("report:1"),
    ):
        pass


def test_make_stale_refuses_a_lease_that_is_not_current():
    lease = acquire("s", ttl=30)
    newer = take_over(lease)
    assert newer.token == lease.token + 1
    with pytest.raises(ValueError, match="not the current grant"):
        make_stale(lease)
    assert Lock.objects.get(name="s").owner == newer.owner


def test_check_reports_models_without_a_usable_fence_name():
    with isolate_apps("tests.testapp") as registry:

        class NoName(FencedModel):
            class Meta:
                app_label = "testapp"

        class BadField(FencedModel):
            fence_name = "x:{missing}"

            class Meta:
                app_label = "testapp"

        class BadSpec(FencedModel):
            fence_name = "x:{pk:05d}"

            class Meta:
                app_label = "testapp"

        class Good(FencedModel):
            fence_name = "x:{pk}"

            class Meta:
                app_label = "testapp"

        class NullableText(FencedModel):
            fence_name = "x:{a}:{b}"
            a = models.CharField(max_length=5, null=True)
            b = models.CharField(max_length=5)

            class Meta:
                app_label = "testapp"

        class NullableNumber(FencedModel):
            fence_name = "x:{n}"
            n = models.IntegerField(null=True)

            class Meta:
                app_label = "testapp"

        class PlainManager(FencedModel):
            fence_name = "x:{pk}"
            objects = models.Manager()

            class Meta:
                app_label = "testapp"

        class OwnMeta(FencedModel):
            fence_name = "x:{pk}"

            class Meta:  # not FencedModel.Meta's child: the base manager is set anyway
                app_label = "testapp"
                ordering = ["pk"]

        found = checks.check_fenced_models(registry.get_app_configs())
    assert sorted((m.obj.__name__, m.id) for m in found) == [
        ("BadField", "distlock.E011"), ("BadSpec", "distlock.E011"),
        ("NoName", "distlock.E010"), ("NullableNumber", "distlock.E012"),
        ("NullableText", "distlock.E012"), ("PlainManager", "distlock.W010"),
        ("PlainManager", "distlock.W010"),
    ]
    assert sorted(m.msg.split(" ")[0] for m in found if m.id == "distlock.W010") == [
        "testapp.PlainManager._base_manager", "testapp.PlainManager.objects",
    ]
    assert OwnMeta._base_manager.name == "objects"
    assert "field 'a'" in next(m.msg for m in found if m.obj is NullableText)
    assert checks.check_fenced_models() == []
    assert checks.check_fenced_models in registry_checks()


def registry_checks():
    from django.core.checks.registry import registry

    return registry.get_checks()
