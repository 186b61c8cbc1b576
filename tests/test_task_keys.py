"""enqueue_once's key rows over time: purging the idle ones (purge_task_keys and
distlock_purge) without a key that comes back repeating a generation an old message
carries. No worker runs here: the sends go to django-tasks-db's table on a queue nobody
takes, and a run's start is distlock's own code (the wrapper's first step), called as a
worker would."""

from __future__ import annotations

import uuid
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connections, transaction
from django_tasks_db.models import DBTaskResult

from distlock.db import db_now_us
from distlock.integrations import unique
from distlock.integrations.unique import (
    UNIQUE_KWARG,
    _Run,
    count_idle_task_keys,
    enqueue_once,
    purge_task_keys,
)
from distlock.models import TaskKey
from tests.support import unique_tasks

pytestmark = pytest.mark.django_db(transaction=True)

QUEUED = unique_tasks.unique_body.using(queue_name="nobody")
MINUTE_US = 60 * 10**6
TIMES = ("queued_until_us", "running_until_us", "enqueued_us", "started_us", "waiting_us")


def key() -> str:
    return f"keys:{uuid.uuid4().hex[:12]}"


def idle_row(name: str, **recent: int) -> TaskKey:
    """A key row whose every time is two minutes old, but those given."""
    old = db_now_us("default") - 2 * MINUTE_US
    return TaskKey.objects.create(name=name, **{**dict.fromkeys(TIMES, old), **recent})


def sent_generations(k: str) -> list[int]:
    """The generation each message sent for key ``k`` carries (django-tasks-db's rows)."""
    found = DBTaskResult.objects.filter(task_path=unique_tasks.unique_body.module_path)
    return [r.args_kwargs["kwargs"][UNIQUE_KWARG][1] for r in found
            if r.args_kwargs["args"][0] == k]


def test_only_keys_idle_in_every_time_they_hold_are_purged():
    """A key row is kept while any of its times is recent: a slot that still counts (its
    end ahead), a send, a start or a wait within ``idle``."""
    now = db_now_us("default")
    idle = [idle_row(key()), TaskKey.objects.create(name=key())]  # old; never used
    kept = {column: idle_row(key(), **{column: now - 10 * 10**6}) for column in TIMES}
    ahead = idle_row(key(), queued_until_us=now + MINUTE_US, running_until_us=now + MINUTE_US)
    assert count_idle_task_keys(MINUTE_US, "default") == 2
    assert purge_task_keys(idle=60) == 2
    left = set(TaskKey.objects.values_list("name", flat=True))
    assert left == {row.name for row in kept.values()} | {ahead.name}
    assert not {row.name for row in idle} & left
    # At 0, a time in the past is idle; a slot whose end is ahead still counts.
    assert purge_task_keys(idle=0) == len(TIMES)
    assert list(TaskKey.objects.values_list("name", flat=True)) == [ahead.name]


def test_a_purged_key_that_comes_back_never_repeats_an_old_messages_generation():
    """An old debounced message still in a queue after its key was purged and enqueued
    again skips its body: only the new latest runs."""
    k = key()
    assert enqueue_once(k, QUEUED, [k, 0], policy="debounce", window=600, ttl=60)
    [old] = sent_generations(k)
    assert TaskKey.objects.get(name=k).generation == old
    TaskKey.objects.filter(name=k).update(**dict.fromkeys(TIMES, 0))  # idle since 1970
    assert purge_task_keys(idle=60) == 1
    assert enqueue_once(k, QUEUED, [k, 1], policy="debounce", window=600, ttl=60)
    [first, new] = sorted(sent_generations(k))
    assert first == old and new > old
    assert TaskKey.objects.get(name=k).generation == new
    assert _Run([k, old, "default"]).start() is False  # superseded: skips
    latest = _Run([k, new, "default"])
    assert latest.start() is True
    latest.end()


def test_generations_grow_by_one_per_send():
    k = key()
    for n in range(3):
        assert enqueue_once(k, QUEUED, [k, n], policy="debounce", window=600, ttl=60)
    first, second, third = sorted(sent_generations(k))
    assert (second - first, third - second) == (1, 1)
    assert first > db_now_us("default") - MINUTE_US  # started at the clock, not at 0


def test_a_key_claimed_between_the_purges_read_and_its_delete_is_kept():
    """The delete checks the idle condition again on the rows it deletes: here a send
    lands (on the purge's own connection, right after its read of the names) on one of
    the two idle rows it read."""
    claimed, gone = sorted([key(), key()])
    idle_row(claimed)
    idle_row(gone)
    connection = connections["default"]

    def claim_after_the_read(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if sql.lstrip().upper().startswith("SELECT NAME"):
            TaskKey.objects.filter(name=claimed).update(enqueued_us=db_now_us("default"))
        return result

    with connection.execute_wrapper(claim_after_the_read):
        assert purge_task_keys(idle=60) == 1
    assert list(TaskKey.objects.values_list("name", flat=True)) == [claimed]


def test_more_keys_than_a_batch_are_all_purged(monkeypatch):
    monkeypatch.setattr(unique, "PURGE_BATCH", 3)
    names = [key() for _ in range(7)]
    for name in names:
        idle_row(name)
    assert purge_task_keys(idle=60) == 7
    assert not TaskKey.objects.filter(name__in=names).exists()


class Rollback(Exception):
    pass


def test_a_purge_inside_the_callers_transaction_is_part_of_it():
    k = key()
    idle_row(k)
    with pytest.raises(Rollback), transaction.atomic():
        assert purge_task_keys(idle=60) == 1
        assert not TaskKey.objects.filter(name=k).exists()
        raise Rollback
    assert TaskKey.objects.filter(name=k).exists()  # rolled back with the caller's work


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"idle": -1}, ValueError),
        ({"idle": "1d"}, TypeError),
        ({"idle": float("nan")}, ValueError),
        ({"using": "nowhere"}, ValueError),
    ],
)
def test_bad_input_is_refused_and_deletes_nothing(kwargs, error):
    idle_row(key())
    with pytest.raises(error):
        purge_task_keys(**kwargs)
    assert TaskKey.objects.count() == 1


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_distlock_purge_deletes_idle_task_keys_and_says_so_only_when_there_are_any():
    for _ in range(2):
        idle_row(key())
    recent = idle_row(key(), enqueued_us=db_now_us("default"))
    out = run("distlock_purge", "--skip-events", "--idle", "1m", "--dry-run")
    assert out.splitlines() == [
        "Would delete 0 lock row(s) idle for at least 1 min (dry run: nothing deleted).",
        "Would delete 2 task key(s) idle for at least 1 min.",
    ]
    assert TaskKey.objects.count() == 3
    out = run("distlock_purge", "--skip-events", "--idle", "1m")
    assert out.splitlines() == [
        "Deleted 0 lock row(s) idle for at least 1 min.",
        "Deleted 2 task key(s) idle for at least 1 min.",
    ]
    assert list(TaskKey.objects.values_list("name", flat=True)) == [recent.name]
    out = run("distlock_purge", "--skip-events", "--idle", "1m")
    assert out.splitlines() == ["Deleted 0 lock row(s) idle for at least 1 min."]
