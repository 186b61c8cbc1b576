"""distlock's enqueue-time uniqueness (enqueue_once) with a real Celery worker and real
Django Tasks ``db_worker`` processes.

The Celery broker is the filesystem transport, or Redis on the PostgreSQL run when
DISTLOCK_TEST_REDIS is configured (tests.support.celery_app.broker_url). What is sent is
seen where it leaves: Celery's ``before_task_publish`` in this process, the task rows of
django-tasks-db. The task bodies (tests/support/celery_app.unique_body,
tests/support/unique_tasks.unique_body) record their runs; a held body waits for the test's
go file, so "while a run is running" is a state the test holds, not a race it hopes for.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, shared_task
from celery.signals import before_task_publish
from django.db import connections, transaction
from django.db.transaction import TransactionManagementError
from django_tasks_db.models import DBTaskResult

from distlock import celery as distlock_celery
from distlock import tasks as distlock_tasks
from distlock.backends.mysql import exact_collation
from distlock.db import db_now_us
from distlock.integrations.unique import UNIQUE_KWARG, aenqueue_once, enqueue_once, unique_task
from distlock.models import TaskKey
from tests.support import unique_tasks
from tests.support.celery_app import broker_url, configure
from tests.support.celery_app import unique_body as celery_body
from tests.support.celery_workers import Worker
from tests.support.events import Events
from tests.support.helpers import run_async, wait_until
from tests.support.processes import Children
from tests.support.task_workers import start_workers
from tests.testapp.models import Counter

pytestmark = [pytest.mark.processes, pytest.mark.django_db(transaction=True)]

REDIS = broker_url().startswith("redis")
django_body = unique_tasks.unique_body


class Rollback(Exception):
    """Raised to roll the caller's transaction back."""


def key() -> str:
    return f"uniq:{uuid.uuid4().hex[:12]}"


def row(k: str) -> TaskKey | None:
    return TaskKey.objects.filter(name=k).first()


# --- what is sent ------------------------------------------------------------------------


class Published:
    """The unique tasks this process publishes to the Celery broker: (key, n, in_atomic)
    per message, in_atomic saying whether the default connection was inside atomic()."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, bool]] = []

    def __call__(self, body: Any = None, headers: Any = None, **kwargs: Any) -> None:
        args, kw = body[0], body[1]
        if UNIQUE_KWARG in kw:
            self.sent.append((args[0], args[1], connections["default"].in_atomic_block))

    def of(self, k: str) -> list[tuple[str, int, bool]]:
        return [sent for sent in self.sent if sent[0] == k]


@pytest.fixture
def published() -> Iterator[Published]:
    seen = Published()
    before_task_publish.connect(seen, weak=False)
    try:
        yield seen
    finally:
        before_task_publish.disconnect(seen)


def django_sent(k: str, status: str | None = None) -> list[DBTaskResult]:
    """The task rows django-tasks-db holds for key ``k`` (every status, or one)."""
    found = DBTaskResult.objects.filter(task_path=django_body.module_path)
    if status is not None:
        found = found.filter(status=status)
    return [r for r in found if r.args_kwargs["args"][0] == k]


# --- workers -----------------------------------------------------------------------------


class Setup:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.events = Events(base)

    def go(self, k: str) -> None:
        (self.base / f"go-{k}").touch()


@pytest.fixture(scope="module")
def celery(django_db_setup, tmp_path_factory) -> Iterator[Setup]:
    """One prefork worker (2 children: a running and a waiting run) on a queue of its own."""
    base = tmp_path_factory.mktemp("unique-celery")
    queue = f"distlock-unique-{uuid.uuid4().hex[:8]}"
    configure(base, queue)
    worker = Worker(base, queue, name="distlock-unique")
    try:
        worker.wait_ready()
        yield Setup(base)
    finally:
        worker.stop()
        if REDIS:
            from tests.test_celery import drop_queue

            drop_queue(queue)


@pytest.fixture(scope="module")
def db_workers(django_db_setup, tmp_path_factory) -> Iterator[Setup]:
    """Two db_worker processes (a running and a waiting run)."""
    base = tmp_path_factory.mktemp("unique-tasks")
    workers = start_workers(base, 2)
    try:
        yield Setup(base)
    finally:
        for worker in workers:
            worker.stop()


# --- the contract, without workers --------------------------------------------------------


def test_exported_from_both_integrations():
    for module in (distlock_celery, distlock_tasks):
        assert module.enqueue_once is enqueue_once
        assert module.aenqueue_once is aenqueue_once
        assert module.unique_task is unique_task
        assert {"enqueue_once", "aenqueue_once", "unique_task"} <= set(module.__all__)


def test_the_decorator_refuses_what_it_cannot_guard():
    other = Celery("unique-order-check", set_as_current=False)

    def plain(k):
        return k

    with pytest.raises(TypeError, match="under the task decorator"):
        unique_task(other.task(name="tests.unique_misplaced")(plain))
    with pytest.raises(TypeError, match="under the task decorator"):
        unique_task(shared_task(name="tests.unique_misplaced_shared")(plain))
    with pytest.raises(TypeError, match="under the task decorator"):
        unique_task(django_body)

    async def coro(k):
        return k

    with pytest.raises(TypeError, match="async function"):
        unique_task(coro)

    def reserved(k, distlock_unique=None):
        return k

    with pytest.raises(TypeError, match="reserved"):
        unique_task(reserved)


def test_a_run_not_sent_by_enqueue_once_runs_as_before():
    assert celery_body.run("k", 3) == 3
    assert django_body.call("k", 4) == 4
    assert "distlock_unique" in str(celery_body.run.__signature__)


def test_bad_arguments_are_refused_and_change_nothing(published):
    k = key()

    def not_unique(k, n):
        return n

    plain = Celery("unique-bad", set_as_current=False).task(name="tests.unique_plain")(not_unique)
    bad: list[tuple[type[Exception], str, dict[str, Any]]] = [
        (TypeError, "lock name must be a str", {"key": 7}),
        (ValueError, "must not be empty", {"key": ""}),
        (TypeError, "Celery task or a Django task", {"task": print}),
        (TypeError, "does not carry @unique_task", {"task": plain}),
        (TypeError, "args must be a list", {"args": "ab"}),
        (TypeError, "kwargs must be a dict", {"kwargs": [1]}),
        (TypeError, "passed by enqueue_once", {"kwargs": {UNIQUE_KWARG: [k, 1, "default"]}}),
        (ValueError, "policy must be one of", {"policy": "sometimes"}),
        (TypeError, "policy must be a str", {"policy": None}),
        (ValueError, "needs window", {"policy": "debounce"}),
        (ValueError, "window must be more than 0", {"policy": "debounce", "window": 0}),
        (ValueError, "is for policy 'debounce'", {"window": 1}),
        (ValueError, "ttl must be at least", {"ttl": 0}),
        (TypeError, "ttl must be", {"ttl": "1"}),
        (ValueError, "not a database alias", {"using": "nowhere"}),
    ]
    for error, message, change in bad:
        call: dict[str, Any] = {
            "key": k, "task": celery_body, "args": [k, 0], "kwargs": None, **change,
        }
        with pytest.raises(error, match=message):
            enqueue_once(call.pop("key"), call.pop("task"), call.pop("args"), **call)
    assert row(k) is None
    assert published.sent == []
    assert django_sent(k) == []


def test_autocommit_off_by_hand_is_refused_and_changes_nothing(published):
    k = key()
    transaction.set_autocommit(False)
    try:
        Counter.objects.create(key=k)
        with pytest.raises(TransactionManagementError, match="autocommit turned off"):
            enqueue_once(k, django_body, [k, 0])
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert Counter.objects.filter(key=k).exists()  # the caller's own write is untouched
    assert row(k) is None
    assert django_sent(k) == []


# --- the caller's transaction ------------------------------------------------------------


def test_a_rollback_sends_nothing_and_leaves_no_row(celery, published):
    k = key()
    with pytest.raises(Rollback), transaction.atomic():
        Counter.objects.create(key=k)
        assert enqueue_once(k, celery_body, [k, 0]) is True
        assert row(k) is not None  # written in the caller's transaction ...
        raise Rollback
    assert row(k) is None  # ... and rolled back with it
    assert not Counter.objects.filter(key=k).exists()
    assert published.of(k) == []
    # The same enqueue committed: sent once, after the commit.
    with transaction.atomic():
        Counter.objects.create(key=k)
        assert enqueue_once(k, celery_body, [k, 1]) is True
        assert enqueue_once(k, celery_body, [k, 2]) is False  # covered by the first
        assert published.of(k) == []
    assert published.of(k) == [(k, 1, False)]
    celery.events.wait(kind="unique_end", key=k, timeout=30)


def test_a_rollback_on_django_tasks_sends_nothing_and_leaves_no_row():
    k = key()
    with pytest.raises(Rollback), transaction.atomic():
        Counter.objects.create(key=k)
        assert enqueue_once(k, django_body.using(queue_name="nobody"), [k, 0]) is True
        raise Rollback
    assert row(k) is None
    assert django_sent(k) == []
    assert enqueue_once(k, django_body.using(queue_name="nobody"), [k, 1]) is True
    assert [r.args_kwargs["args"] for r in django_sent(k)] == [[k, 1]]


@pytest.mark.django_db(transaction=True, databases=["default", "locks"])
def test_the_key_row_follows_the_alias_it_is_given(celery, published):
    k = key()
    with pytest.raises(Rollback), transaction.atomic(using="locks"):
        enqueue_once(k, celery_body, [k, 0], using="locks")
        raise Rollback
    assert row(k) is None
    assert published.of(k) == []
    if connections["default"].vendor == "sqlite":
        return  # atomic() on "default" holds SQLite's one write lock: "locks" would wait
    with pytest.raises(Rollback), transaction.atomic():
        # A transaction on another alias is not the key's: the key commits on its own.
        assert enqueue_once(k, celery_body, [k, 1], using="locks") is True
        assert len(published.of(k)) == 1
        raise Rollback
    assert row(k) is not None
    celery.events.wait(kind="unique_end", key=k, timeout=30)


def test_a_send_that_fails_gives_the_queued_slot_back():
    k = key()
    queued = django_body.using(queue_name="nobody")
    with pytest.raises((TypeError, ValueError)):
        enqueue_once(k, queued, [k, {"not JSON"}])  # refused by the backend, after commit
    found = row(k)
    assert found is not None and found.queued_until_us is None
    assert django_sent(k) == []
    assert enqueue_once(k, queued, [k, 1]) is True  # the key is not blocked until its ttl


def test_aenqueue_once_from_async_code():
    k = key()
    queued = django_body.using(queue_name="nobody")

    async def main() -> list[bool]:
        return [await aenqueue_once(k, queued, [k, n]) for n in range(3)]

    assert run_async(main) == [True, False, False]
    assert [r.args_kwargs["args"] for r in django_sent(k)] == [[k, 0]]
    with pytest.raises(ValueError, match="policy"):
        run_async(lambda: aenqueue_once(k, queued, [k, 3], policy="never"))


def test_keys_are_compared_exactly_as_lock_names_are():
    """A key differing only in case, an accent or a trailing space is another key, on
    every backend: MariaDB's default collations fold all three (the key column is a
    LockNameField, binary NO PAD there), and a folded key would drop the other's task."""
    base = f"{key()}:abé"
    keys = [base, base.replace("ab", "AB"), base.replace("é", "e"), f"{base} "]
    if connections["default"].vendor == "mysql":
        with connections["default"].cursor() as cursor:
            # Not vacuous: the database's own collation folds the three spellings ...
            cursor.execute("SELECT %s = %s, %s = %s, %s = %s", [
                keys[0], keys[1], keys[0], keys[2], keys[0], keys[3]])
            assert cursor.fetchone() == (1, 1, 1)
            # ... and the key column's does not.
            cursor.execute(
                "SELECT COLLATION_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA ="
                " DATABASE() AND TABLE_NAME = 'distlock_taskkey' AND COLUMN_NAME = 'name'"
            )
            assert exact_collation(cursor.fetchone()[0])
    queued = django_body.using(queue_name="nobody")
    assert [enqueue_once(k, queued, [k, 0]) for k in keys] == [True] * 4
    assert [enqueue_once(k, queued, [k, 1]) for k in keys] == [False] * 4  # each covered
    assert sorted(TaskKey.objects.filter(name__startswith=base[:17]).values_list(
        "name", flat=True)) == sorted(keys)
    for k in keys:
        assert [r.args_kwargs["args"] for r in django_sent(k)] == [[k, 0]]


def test_four_processes_enqueueing_one_key_send_exactly_one_task():
    k = key()
    children = Children()
    try:
        started = [
            children.start("tests.support.unique_tasks:enqueuer", k, 25, "nobody")
            for _ in range(4)
        ]
        for child in started:
            child.expect("ready")
        for child in started:
            child.send("go")
        sent = [child.expect("done", timeout=60)["sent"] for child in started]
    finally:
        children.close()
    assert sum(sent) == 1
    assert len(django_sent(k)) == 1
    found = row(k)
    [message] = django_sent(k)
    # One send, and the row's generation is the one it carries.
    assert found is not None
    assert found.generation == message.args_kwargs["kwargs"][UNIQUE_KWARG][1]


# --- real workers: bursts ----------------------------------------------------------------


def burst(k: str, task: Any, count: int, first: int = 0, **options: Any) -> int:
    """``count`` enqueues of ``k`` of held bodies, numbered from ``first``; how many sent."""
    return sum(
        enqueue_once(k, task, [k, n, True], **options) for n in range(first, first + count)
    )


@pytest.mark.parametrize("runner", ["celery", "tasks"])
def test_queued_a_burst_runs_the_body_once(runner, request):
    setup = request.getfixturevalue("celery" if runner == "celery" else "db_workers")
    task = celery_body if runner == "celery" else django_body
    k = key()
    assert burst(k, task, 50, policy="queued", ttl=60) == 1
    setup.events.wait(kind="unique_start", key=k, timeout=30)
    # Running now: still covered.
    assert burst(k, task, 50, 50, policy="queued", ttl=60) == 0
    setup.go(k)
    setup.events.wait(kind="unique_end", key=k, timeout=30)
    assert [e["n"] for e in setup.events.all(kind="unique_start", key=k)] == [0]
    wait_until(lambda: row(k).running_until_us is None, what="the running slot given back")
    # The run is over: the next enqueue sends again.
    assert enqueue_once(k, task, [k, 100], policy="queued", ttl=60) is True
    setup.events.wait(kind="unique_end", key=k, n=100, timeout=30)


@pytest.mark.parametrize("runner", ["celery", "tasks"])
def test_one_running_one_queued_runs_at_most_twice_and_never_at_once(runner, request):
    setup = request.getfixturevalue("celery" if runner == "celery" else "db_workers")
    task = celery_body if runner == "celery" else django_body
    k = key()
    options = {"policy": "one_running_one_queued", "ttl": 60}
    assert burst(k, task, 1, **options) == 1
    setup.events.wait(kind="unique_start", key=k, timeout=30)
    # The first run holds the running slot: one more is queued, the rest are covered.
    assert burst(k, task, 99, 1, **options) == 1
    # The second run is in a worker, waiting for the running slot (not in its body).
    wait_until(
        lambda: row(k).waiting_us or len(setup.events.all(kind="unique_start", key=k)) > 1,
        timeout=30, what="the second run waiting (or started)",
    )
    assert len(setup.events.all(kind="unique_start", key=k)) == 1
    assert row(k).waiting_us is not None
    setup.go(k)
    ends = setup.events.wait(2, kind="unique_end", key=k, timeout=30)
    starts = setup.events.all(kind="unique_start", key=k)
    assert sorted(e["n"] for e in starts) == [0, 1]
    first_end = next(e["db_us"] for e in ends if e["n"] == 0)
    second_start = next(e["db_us"] for e in starts if e["n"] == 1)
    assert second_start >= first_end  # never at once


@pytest.mark.parametrize("runner", ["celery", "tasks"])
def test_debounce_runs_only_the_last_enqueue(runner, request):
    setup = request.getfixturevalue("celery" if runner == "celery" else "db_workers")
    task = celery_body if runner == "celery" else django_body
    k = key()
    sent = 0
    for n in range(100):
        sent += enqueue_once(k, task, [k, n], policy="debounce", window=0.5, ttl=60)
        if n == 0:
            first = row(k).generation
    assert sent == 100  # every enqueue sends; the latest generation runs
    if runner == "celery":
        setup.events.wait(100, kind="postrun", key=k, timeout=60)
    else:
        wait_until(lambda: len(django_sent(k, "SUCCESSFUL")) == 100, timeout=60,
                   what="100 debounced tasks done")
    assert [e["n"] for e in setup.events.all(kind="unique_start", key=k)] == [99]
    assert row(k).generation == first + 99


# --- a worker killed mid-run -------------------------------------------------------------


def test_a_killed_run_blocks_its_key_until_the_ttl_and_no_longer(celery):
    k = key()
    assert enqueue_once(k, celery_body, [k, 0, True], policy="queued", ttl=5) is True
    start = celery.events.wait(kind="unique_start", key=k, timeout=30)[0]
    os.kill(start["pid"], signal.SIGKILL)
    slot = row(k)
    assert slot is not None and slot.running_until_us is not None
    # Before the slot's end by the database clock, the key is still covered.
    assert db_now_us("default") < slot.running_until_us
    assert enqueue_once(k, celery_body, [k, 1], policy="queued", ttl=5) is False
    wait_until(lambda: db_now_us("default") >= slot.running_until_us, timeout=30,
               what="the killed run's slot ended by the database clock")
    assert enqueue_once(k, celery_body, [k, 2], policy="queued", ttl=5) is True
    celery.events.wait(kind="unique_end", key=k, n=2, timeout=30)
    assert not celery.events.all(kind="unique_end", key=k, n=0)


# --- what operators see ------------------------------------------------------------------


def test_the_admin_list_and_the_gauge_show_the_live_slots(django_user_model):
    from django.test import Client
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from distlock.contrib.prometheus.gauges import DatabaseGauges

    queued, running, ended = key(), key(), key()
    nobody = django_body.using(queue_name="nobody")
    for k in (queued, running, ended):
        assert enqueue_once(k, nobody, [k, 0], ttl=60) is True
    now = db_now_us("default")
    TaskKey.objects.filter(name=running).update(
        queued_until_us=None, running_until_us=now + 60_000_000, running_owner="x" * 32
    )
    # A run killed long ago: its slot is past its end by the database clock.
    TaskKey.objects.filter(name=ended).update(queued_until_us=None, running_until_us=now - 1)

    registry = CollectorRegistry()
    registry.register(DatabaseGauges())
    samples = {
        sample.labels.get("slot"): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples if sample.name == "distlock_task_keys"
    }
    assert samples == {"queued": 1, "running": 1}

    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", "r@x.org", "pw"))
    page = client.get("/admin/distlock/taskkey/")
    assert page.status_code == 200
    text = page.content.decode()
    assert all(k in text for k in (queued, running, ended))
    assert text.count(">free<") >= 4  # queued: running free; running: queued free; ended: both
    one = TaskKey.objects.get(name=running)
    from django.contrib.admin.utils import quote

    assert client.get(f"/admin/distlock/taskkey/{quote(one.pk)}/change/").status_code == 200
    assert client.get("/admin/distlock/taskkey/add/").status_code == 403
    assert client.post(f"/admin/distlock/taskkey/{quote(one.pk)}/delete/").status_code == 403
