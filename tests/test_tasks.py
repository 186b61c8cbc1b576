"""distlock.tasks with Django's Tasks framework: real ``db_worker`` processes contending.

Django 6's ``django.tasks`` or, on 5.2, the ``django-tasks`` backport; the worker is
django-tasks-db's ``db_worker`` (tests/support/task_workers.py), three of them for the
module, on the pytest test database. The tasks (tests/support/tasks.py) read-modify-write
a fenced counter under lock ``counter:<key>``. The decorator's contract is tested in
process first, with the immediate backend.
"""

from __future__ import annotations

import inspect
import os
import signal
import uuid
from collections.abc import Iterator
from datetime import timedelta
from importlib import import_module
from pathlib import Path

import pytest

from distlock import Lease, LockTimeout, StaleToken, acquire
from distlock.integrations.tasks import (
    FRAMEWORK,
    CannotRequeue,
    LockContended,
    Retry,
    locked_task,
    task_lock_busy,
)
from distlock.models import Lock
from tests.support import tasks
from tests.support.events import Events
from tests.support.helpers import assert_freed_by_release, released, us
from tests.support.task_workers import DbWorker, start_workers
from tests.testapp.models import Counter

pytestmark = [pytest.mark.processes, pytest.mark.django_db(transaction=True)]

task = import_module(FRAMEWORK).task
SUCCESSFUL, FAILED = "SUCCESSFUL", "FAILED"


def key() -> str:
    return uuid.uuid4().hex[:12]


def counter() -> str:
    """A new counter (the row the tasks write, fenced by lock counter:<key>); its key."""
    k = key()
    Counter.objects.create(key=k)
    return k



# --- in process, on the immediate backend: the decorator's contract -----------------------


def test_lease_is_hidden_from_the_signature_and_the_context_comes_first():
    assert list(inspect.signature(tasks.hold_wait.func).parameters) == [
        "context", "key", "seconds",
    ]
    assert list(inspect.signature(tasks.hold_retry.func).parameters) == ["key"]
    assert not hasattr(tasks.hold_retry.func, "__wrapped__")
    assert tasks.hold_retry.module_path == "tests.support.tasks.hold_retry"


def test_bad_decorator_arguments_are_refused_at_decoration():
    with pytest.raises(TypeError, match="under @task"):
        locked_task("x")(tasks.now_skip)  # a Task: @locked_task was put above @task
    with pytest.raises(ValueError, match="invoice"):
        locked_task("x:{invoice}")(lambda invoice_id: None)
    with pytest.raises(ValueError, match="must be named"):
        locked_task("x:{}")
    with pytest.raises(ValueError, match="must not be empty"):
        locked_task("")
    with pytest.raises(TypeError, match="keyword-only"):
        locked_task("x")(lambda key, lease: None)
    with pytest.raises(TypeError, match="reserved"):
        locked_task("x")(lambda key, distlock_retries=0: None)
    with pytest.raises(TypeError, match="str template or a callable"):
        locked_task(42)
    with pytest.raises(ValueError, match="on_contention"):
        locked_task("x", on_contention="sometimes")
    with pytest.raises(TypeError, match="Retry"):
        locked_task("x", on_contention=Retry(), countdown=5)
    with pytest.raises(ValueError, match="countdown"):
        locked_task("x", countdown=-1)
    with pytest.raises(ValueError, match="max_retries"):
        locked_task("x", max_retries=-1)
    with pytest.raises(ValueError, match="ttl"):
        locked_task("x", ttl=0)
    with pytest.raises(ValueError, match="timeout"):
        locked_task("x", timeout=-1)
    with pytest.raises(TypeError, match="module-level function"):
        locked_task("x")(print)

    async def generator(key):
        yield key

    with pytest.raises(TypeError, match="async generator"):
        locked_task("x")(generator)


def test_immediate_run_gets_its_lease_and_releases_it(lock_db):
    k = key()
    result = tasks.now_skip.enqueue(k)
    assert result.status == SUCCESSFUL
    value = result.return_value
    row = Lock.objects.get(name=f"counter:{k}")
    assert row.is_free and value["token"] == row.token and value["current"] is True
    assert f"task=tests.support.tasks.now_skip[{result.id}]" in value["holder"]
    assert value["attempt"] == 1
    # A name from a callable, no lease parameter: current_lease() has it.
    named = tasks.now_named.enqueue(k)
    assert named.return_value == row.token + 1


def test_an_async_task_runs_under_alock(lock_db):
    k = key()
    assert inspect.iscoroutinefunction(tasks.now_async.func)
    result = tasks.now_async.enqueue(k)
    assert result.status == SUCCESSFUL, result.errors
    row = Lock.objects.get(name=f"counter:{k}")
    assert result.return_value == {"token": row.token, "current": True} and row.is_free
    held = acquire(f"counter:{k}", ttl=30)
    try:
        skipped = tasks.now_async.enqueue(k)  # the policy, run through the sync layer
    finally:
        held.release()
    assert skipped.status == SUCCESSFUL and skipped.return_value is None


def test_a_lease_passed_by_the_caller_is_refused(lock_db):
    result = tasks.now_retry.enqueue(key(), lease="forged")
    assert result.status == FAILED
    assert result.errors[0].exception_class_path == "builtins.TypeError"
    assert "do not pass 'lease' yourself" in result.errors[0].traceback


def test_immediate_body_failure_releases_the_lock(lock_db):
    k = key()
    result = tasks.now_fail.enqueue(k)
    assert result.status == FAILED and "the body failed" in result.errors[0].traceback
    row = Lock.objects.get(name=f"counter:{k}")
    assert row.is_free
    following = acquire(f"counter:{k}", ttl=30, blocking=False)
    assert following is not None and following.token == row.token + 1
    following.release()


def test_skip_on_the_immediate_backend_says_so_and_returns_none(lock_db):
    k = key()
    seen = []

    def busy(sender, **kwargs):
        seen.append((sender, kwargs))

    task_lock_busy.connect(busy)
    held = acquire(f"counter:{k}", ttl=30)
    try:
        result = tasks.now_skip.enqueue(k)
    finally:
        task_lock_busy.disconnect(busy)
        held.release()
    assert result.status == SUCCESSFUL and result.return_value is None
    [(sender, kwargs)] = seen
    assert sender.module_path == "tests.support.tasks.now_skip"
    assert (kwargs["policy"], kwargs["name"], kwargs["task_id"]) == (
        "skip", f"counter:{k}", result.id,
    )


def test_retry_on_a_backend_that_cannot_defer_fails_and_says_why(lock_db):
    k = key()
    held = acquire(f"counter:{k}", ttl=30)
    try:
        result = tasks.now_retry.enqueue(k)
    finally:
        held.release()
    assert result.status == FAILED
    assert result.errors[0].exception_class_path == "distlock.integrations.tasks.CannotRequeue"
    assert "cannot defer a task (supports_defer is False)" in result.errors[0].traceback
    assert "'immediate' (ImmediateBackend)" in result.errors[0].traceback
    assert issubclass(CannotRequeue, LockContended)


def test_called_directly_there_is_nothing_to_requeue(lock_db):
    k = key()
    held = acquire(f"counter:{k}", ttl=30)
    try:
        with pytest.raises(LockContended, match=f"counter:{k}"):
            tasks.now_retry.call(k)
    finally:
        held.release()
    assert tasks.now_retry.call(k) == held.token + 1


# --- with real db_worker processes --------------------------------------------------------


class Setup:
    def __init__(self, base: Path, workers: list[DbWorker]) -> None:
        self.base, self.workers = base, workers
        self.events = Events(base)

    def go(self, k: str) -> None:
        (self.base / f"go-{k}").touch()

    def finished(self, task_id: str, timeout: float = 30.0) -> dict:
        return self.events.wait(kind="finished", task_id=task_id, timeout=timeout)[0]


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Setup]:
    """Three db_worker processes for the module, on the test database."""
    base = tmp_path_factory.mktemp("tasks")
    pool = start_workers(base, 3)
    try:
        yield Setup(base, pool)
    finally:
        for worker in pool:
            worker.stop()


def test_same_key_tasks_never_overlap_and_tokens_increase(workers):
    k = counter()
    ids = [tasks.hold_wait.enqueue(k, 0.2).id for _ in range(6)]
    ends = workers.events.wait(6, kind="end", key=k, timeout=60)
    starts = sorted(workers.events.all(kind="start", key=k), key=lambda e: e["token"])
    assert sorted(e["task_id"] for e in starts) == sorted(ids)
    tokens = [e["token"] for e in starts]
    assert tokens == list(range(tokens[0], tokens[0] + 6))
    end_of = {e["token"]: e["db_us"] for e in ends}
    for earlier, later in zip(starts, starts[1:], strict=False):
        # Granted only after the previous holder finished its body (and released).
        assert later["acquired_us"] >= end_of[earlier["token"]]
    assert all(e["current"] for e in starts)  # current_lease() is the injected lease
    assert all(f"[{e['task_id']}]" in e["holder"] for e in starts)  # its own result id
    assert len({e["owner"] for e in starts}) == 6  # an owner per run
    assert len({e["pid"] for e in starts}) >= 2  # several workers took part
    assert Counter.objects.get(key=k).value == 6  # no lost update
    for task_id in ids:
        assert workers.finished(task_id)["status"] == SUCCESSFUL
    released(f"counter:{k}")


def test_async_and_sync_runs_of_one_lock_never_overlap(workers):
    k = counter()
    ids = [task.enqueue(k, 0.1).id for task in [tasks.hold_async, tasks.hold_wait] * 3]
    workers.events.wait(6, kind="end", key=k, timeout=60)
    starts = sorted(workers.events.all(kind="start", key=k), key=lambda e: e["token"])
    ends = {e["token"]: e["db_us"] for e in workers.events.all(kind="end", key=k)}
    assert sorted(e["task_id"] for e in starts) == sorted(ids)
    assert len([e for e in starts if e.get("run") == "async"]) == 3
    tokens = [e["token"] for e in starts]
    assert tokens == list(range(tokens[0], tokens[0] + 6))
    for earlier, later in zip(starts, starts[1:], strict=False):
        assert later["acquired_us"] >= ends[earlier["token"]]
    assert all(e["current"] for e in starts)
    assert Counter.objects.get(key=k).value == 6
    released(f"counter:{k}")


def test_an_async_task_is_requeued_on_contention(workers):
    k = counter()
    held = acquire(f"counter:{k}", ttl=30)
    first = tasks.retry_async.enqueue(k)
    busy = workers.events.wait(2, kind="busy", name=f"counter:{k}")
    assert [e["retries"] for e in busy[:2]] == [0, 1] and busy[0]["task_id"] == first.id
    assert workers.finished(first.id)["status"] == SUCCESSFUL
    assert held.release() is True
    start = workers.events.wait(kind="start", key=k)[0]
    assert start["run"] == "async" and start["token"] > held.token
    workers.events.wait(kind="end", key=k)
    assert Counter.objects.get(key=k).value == 1


def test_skip_does_not_run_the_body_and_says_so(workers):
    k = counter()
    held = acquire(f"counter:{k}", ttl=30)
    skipped = tasks.hold_skip.enqueue(k).id
    busy = workers.events.wait(kind="busy", task_id=skipped)[0]
    assert (busy["policy"], busy["name"], busy["sender"]) == ("skip", f"counter:{k}",
                                                              "hold_skip")
    assert workers.finished(skipped)["status"] == SUCCESSFUL
    assert held.release() is True
    ran = tasks.hold_skip.enqueue(k).id
    assert workers.finished(ran)["status"] == SUCCESSFUL
    assert workers.events.all(kind="start", task_id=skipped) == []
    assert Counter.objects.get(key=k).value == 1


def test_retry_requeues_with_run_after_then_runs_with_a_higher_token(workers):
    k = counter()
    held = acquire(f"counter:{k}", ttl=30)
    first = tasks.hold_retry.enqueue(k)
    busy = workers.events.wait(3, kind="busy", name=f"counter:{k}")
    assert [e["retries"] for e in busy[:3]] == [0, 1, 2]
    assert all(e["policy"] == "retry" and 0.2 <= e["countdown"] <= 0.3 for e in busy)
    # Each retry is a new result, deferred by the countdown; the contended run succeeded
    # (returning None) rather than failing.
    assert busy[0]["task_id"] == first.id and len({e["task_id"] for e in busy}) == len(busy)
    queued = first.task.get_result(busy[1]["task_id"])
    assert queued.kwargs == {"distlock_retries": 1} and queued.args == [k]
    # run_after = the worker's now + the countdown (0.2 s + jitter); enqueued_at is stamped
    # a moment later, when the row is saved.
    assert queued.task.run_after - queued.enqueued_at >= timedelta(seconds=0.15)
    assert workers.finished(first.id)["status"] == SUCCESSFUL
    assert first.task.get_result(first.id).return_value is None
    assert held.release() is True
    start = workers.events.wait(kind="start", key=k)[0]
    assert start["token"] > held.token and " retry=" in start["holder"]
    workers.events.wait(kind="end", key=k)
    assert Counter.objects.get(key=k).value == 1


def test_retry_gives_up_after_max_retries(workers):
    k = counter()
    held = acquire(f"counter:{k}", ttl=30)
    first = tasks.hold_retry_once.enqueue(k)
    busy = workers.events.wait(2, kind="busy", name=f"counter:{k}")
    last = workers.finished(busy[1]["task_id"])
    assert last["status"] == FAILED
    assert last["errors"] == ["distlock.integrations.policies.LockContended"]
    assert last["kwargs"] == {"distlock_retries": 1}
    assert [(e["retries"], e["countdown"]) for e in busy] == [(0, 0.1), (1, 0.1)]
    assert workers.finished(first.id)["status"] == SUCCESSFUL
    assert workers.events.all(kind="start", key=k) == []
    assert held.release() is True


def test_wait_gets_the_lock_when_the_holder_expires_or_gives_up(workers):
    k, short = counter(), counter()
    expiring = acquire(f"counter:{k}", ttl=1.5)  # never released: it must expire
    held = acquire(f"counter:{short}", ttl=30)
    waited = tasks.hold_wait.enqueue(k).id
    gave_up = tasks.hold_wait_short.enqueue(short).id
    raised = tasks.hold_raise.enqueue(short).id
    for task_id, error in [(gave_up, "distlock.exceptions.LockTimeout"),
                           (raised, "distlock.integrations.policies.LockContended")]:
        outcome = workers.finished(task_id)
        assert outcome["status"] == FAILED and outcome["errors"] == [error]
    policies = {e["task_id"]: e["policy"] for e in workers.events.all(kind="busy")}
    assert (policies[gave_up], policies[raised]) == ("wait", "raise")
    start = workers.events.wait(kind="start", task_id=waited)[0]
    assert start["token"] == expiring.token + 1
    assert start["acquired_us"] >= us(expiring.expires_at)
    assert workers.finished(waited)["status"] == SUCCESSFUL
    assert expiring.release() is False and held.release() is True
    assert LockTimeout.__name__ in workers.finished(gave_up)["errors"][0]


def test_a_task_whose_body_raises_releases_its_lock_at_once(workers):
    k = counter()
    task_id = tasks.fail.enqueue(k).id
    outcome = workers.finished(task_id)
    assert outcome["status"] == FAILED and outcome["errors"] == ["builtins.RuntimeError"]
    start = workers.events.all(kind="start", task_id=task_id)[0]
    assert_freed_by_release(f"counter:{k}", start)


def test_a_lock_timeout_of_the_body_fails_the_task_and_is_not_contention(workers):
    """The body's own lock times out, in a sync and in an async task: that LockTimeout
    fails the run as the body's error; the decorator's policy (skip) is not applied, and
    the task's lock is released."""
    runs = {counter(): tasks.inner_times_out, counter(): tasks.inner_times_out_async}
    inner = {k: acquire(f"counter:{k}:inner", ttl=30) for k in runs}
    try:
        ids = {k: run.enqueue(k).id for k, run in runs.items()}
        outcomes = {k: workers.finished(task_id) for k, task_id in ids.items()}
    finally:
        for lease in inner.values():
            assert lease.release() is True
    for k, task_id in ids.items():
        assert outcomes[k]["status"] == FAILED, f"{runs[k].name}: {outcomes[k]}"
        assert outcomes[k]["errors"] == ["distlock.exceptions.LockTimeout"]
        assert workers.events.all(kind="busy", task_id=task_id) == []
        assert workers.events.all(kind="end", task_id=task_id) == []
        start = workers.events.all(kind="start", task_id=task_id)[0]
        assert_freed_by_release(f"counter:{k}", start)


def test_a_worker_paused_past_its_ttl_cannot_write_after_the_next_run_took_over(workers):
    """SIGSTOP the worker holding the lock: the next run takes over at the lease's expiry
    with a higher token; the paused run, continued, has its fenced write refused."""
    k = counter()
    first = tasks.killable.enqueue(k)  # holds until the go file
    start = workers.events.wait(kind="start", task_id=first.id)[0]
    os.kill(start["pid"], signal.SIGSTOP)  # a worker of this module: its db_worker process
    try:
        second = tasks.killable.enqueue(k, 0)
        taken = workers.events.wait(kind="start", task_id=second.id)[0]
        assert taken["token"] == start["token"] + 1 and taken["pid"] != start["pid"]
        assert taken["acquired_us"] >= start["expires_us"]
        assert workers.finished(second.id)["status"] == SUCCESSFUL
        workers.go(k)
    finally:
        os.kill(start["pid"], signal.SIGCONT)
    outcome = workers.finished(first.id)
    assert outcome["status"] == FAILED
    assert outcome["errors"] == ["distlock.exceptions.StaleToken"]
    assert workers.events.all(kind="end", task_id=first.id) == []
    row = Counter.objects.get(key=k)
    assert (row.value, row.fence_token) == (1, taken["token"])


def test_a_sigkilled_worker_leaves_its_lease_to_expire_and_the_next_run_takes_over(workers):
    """SIGKILL the worker mid-task: django-tasks-db does not run the task again (its result
    stays RUNNING); the lease runs out at its ttl, the next run of the lock gets a higher
    token, and a write made with the dead run's lease is refused."""
    queue = f"kill-{key()}"
    pair = start_workers(workers.base, 2, queue)  # workers of this test only: one dies
    try:
        k = counter()
        first = tasks.killable.using(queue_name=queue).enqueue(k)
        start = workers.events.wait(kind="start", task_id=first.id)[0]
        second = tasks.killable.using(queue_name=queue).enqueue(k, 0)
        victim = next(worker for worker in pair if worker.pid == start["pid"])
        victim.stop()  # SIGKILL
        taken = workers.events.wait(kind="start", task_id=second.id)[0]
        assert taken["token"] == start["token"] + 1 and taken["pid"] != start["pid"]
        # Not released by the dead holder: granted at its expiry, not before.
        assert taken["acquired_us"] >= start["expires_us"]
        assert workers.finished(second.id)["status"] == SUCCESSFUL
        stale = Lease(f"counter:{k}", start["owner"], start["token"], using="default", ttl=1.5)
        with pytest.raises(StaleToken):
            Counter.objects.filter(key=k).fenced_update(stale, value=99)
        row = Counter.objects.get(key=k)
        assert (row.value, row.fence_token) == (1, taken["token"])
        first.refresh()
        assert first.status == "RUNNING" and workers.events.all(kind="end", task_id=first.id) == []
    finally:
        for worker in pair:
            worker.stop()


def test_the_framework_is_djangos_own_where_it_has_one():
    import django

    assert ("django.tasks" if django.VERSION >= (6,) else "django_tasks") == FRAMEWORK
    assert tasks.hold_wait.__class__.__module__ == f"{FRAMEWORK}.base"
