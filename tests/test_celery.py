"""distlock.celery with real ``celery worker`` processes (tests/support/celery_app.py).

The broker is the filesystem transport, or Redis on the PostgreSQL run when
DISTLOCK_TEST_REDIS is configured (tests.support.celery_app.broker_url; DISTLOCK_TEST_BROKER
forces one). Workers use the pytest test database. Nothing here runs a task eagerly,
except the one test that only checks a log line.
"""

from __future__ import annotations

import inspect
import logging
import os
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from celery import Celery, shared_task
from kombu import Exchange, Queue

from distlock import acquire, current_lease
from distlock.db import db_now_us
from distlock.integrations.celery import (
    ContentionPolicy,
    LockContended,
    Raise,
    Retry,
    Skip,
    Wait,
    locked_task,
    visibility_timeout,
)
from distlock.integrations.policies import resolve
from distlock.models import Lock
from tests.support.celery_app import (
    app,
    broker_url,
    configure,
    fail,
    hold_raise,
    hold_renewed,
    hold_retry,
    hold_retry_once,
    hold_skip,
    hold_wait,
    hold_wait_short,
    inner_times_out,
    killable,
    late_skip,
    obj_raise,
    obj_retry,
    obj_retry_once,
    obj_skip,
    obj_wait,
    obj_wait_short,
    retry_gated,
    retry_self,
    unbound,
)
from tests.support.celery_workers import Worker
from tests.support.events import Events
from tests.support.helpers import assert_freed_by_release, released, us

pytestmark = [pytest.mark.processes, pytest.mark.django_db(transaction=True)]

REDIS = broker_url().startswith("redis")


class Setup:
    def __init__(self, base: Path, queue: str, worker: Worker) -> None:
        self.base, self.queue, self.worker = base, queue, worker
        self.events = Events(base)

    def go(self, key: str) -> None:
        (self.base / f"go-{key}").touch()


@pytest.fixture(scope="module")
def celery(django_db_setup, tmp_path_factory) -> Iterator[Setup]:
    """One prefork worker (2 children) for the module, on the session's own queue."""
    base = tmp_path_factory.mktemp("celery")
    queue = f"distlock-test-{uuid.uuid4().hex[:8]}"
    configure(base, queue)
    worker = Worker(base, queue)
    try:
        worker.wait_ready()
        yield Setup(base, queue, worker)
    finally:
        worker.stop()
        if REDIS:
            drop_queue(queue)


def drop_queue(queue: str) -> None:
    """Delete a Redis queue of this session and its exchange binding."""
    with app.connection_for_write() as conn:
        # Declared as Celery declares it, so that deleting it also drops its binding.
        bound = Queue(queue, Exchange(queue), routing_key=queue)(conn.default_channel)
        bound.declare()
        bound.delete()


def key() -> str:
    return uuid.uuid4().hex[:12]



# --- without a worker: the decorator's contract --------------------------------------


def test_lease_is_hidden_from_the_signature_and_celery_still_checks_arguments():
    assert "lease" not in inspect.signature(hold_wait.run).parameters
    assert list(inspect.signature(hold_wait.run).parameters) == ["key", "seconds"]
    for bad in [(), ("k", 1, 2)]:
        with pytest.raises(TypeError):
            hold_wait.delay(*bad)
    with pytest.raises(TypeError):
        hold_wait.delay("k", lease="forged")


def test_bad_decorator_arguments_are_refused_at_decoration():
    other = Celery("order-check", set_as_current=False)

    def misplaced():
        pass

    task = other.task(name="tests.misplaced")(misplaced)
    with pytest.raises(TypeError, match="under @shared_task"):
        locked_task("x")(task)
    with pytest.raises(TypeError, match="under @shared_task"):
        locked_task("x")(shared_task(name="tests.misplaced_shared")(misplaced))
    with pytest.raises(ValueError, match="on_contention"):
        locked_task("x", on_contention="sometimes")
    with pytest.raises(ValueError, match="invoice"):
        locked_task("x:{invoice}")(lambda self, invoice_id: None)
    with pytest.raises(TypeError, match="keyword-only"):
        locked_task("x")(lambda self, lease: None)
    with pytest.raises(ValueError, match="countdown"):
        locked_task("x", countdown=-1)
    with pytest.raises(ValueError, match="max_retries"):
        locked_task("x", max_retries=-1)
    with pytest.raises(ValueError, match="ttl"):
        locked_task("x", ttl=0)
    with pytest.raises(TypeError):
        locked_task(42)


def test_policy_objects_check_their_options_when_made():
    assert Retry() == Retry(1.0, max_retries=None, jitter=True) == Retry(1, jitter=1.0)
    assert (Retry(2).countdown, Retry(2).jitter, Retry(2, jitter=False).jitter) == (2, 2, 0)
    assert Retry(timedelta(milliseconds=500), jitter=0.25).countdown == 0.5
    assert repr(Retry(0.5, max_retries=3, jitter=False)) == (
        "Retry(countdown=0.5, jitter=0.0, max_retries=3)"
    )
    assert repr(Skip()) == "Skip()" and repr(Wait(3)) == "Wait(timeout=3.0)"
    assert Wait() == Wait(None) and Wait(2) != Wait(3) and Skip() != Raise()
    assert Wait(timedelta(seconds=2)).timeout == 2.0
    for bad, error, match in [
        (lambda: Retry(-1), ValueError, "countdown must not be negative"),
        (lambda: Retry("1"), TypeError, "countdown"),
        (lambda: Retry(float("nan")), ValueError, "countdown must be finite"),
        (lambda: Retry(jitter=-0.5), ValueError, "jitter must not be negative"),
        (lambda: Retry(jitter="x"), TypeError, "jitter"),
        (lambda: Retry(max_retries=-1), ValueError, "max_retries"),
        (lambda: Retry(max_retries=True), ValueError, "max_retries"),
        (lambda: Retry(max_retries=1.5), ValueError, "max_retries"),
        (lambda: Retry(1, 3), TypeError, "positional"),
        (lambda: Wait(-1), ValueError, "timeout must not be negative"),
        (lambda: Wait("soon"), TypeError, "timeout"),
        (lambda: Skip(1), TypeError, "argument"),
        (lambda: Raise(timeout=1), TypeError, "argument"),
    ]:
        with pytest.raises(error, match=match):
            bad()


def test_aliases_are_the_policy_objects_and_options_are_given_once():
    def options(**given):
        return {"timeout": None, "countdown": 1.0, "max_retries": None, "jitter": True, **given}

    assert resolve("skip", **options()) == Skip()
    assert resolve("raise", **options()) == Raise()
    assert resolve("wait", **options(timeout=4.0)) == Wait(4)
    assert resolve("retry", **options(countdown=0.2, max_retries=5, jitter=False)) == Retry(
        0.2, max_retries=5, jitter=False
    )
    policy = Retry(3)
    assert resolve(policy, **options()) is policy
    # Waiting: the policy's own timeout, else locked_task's, else the ttl; the others
    # try for locked_task's timeout, once by default.
    assert (Wait(2).limit(30, None), Wait().limit(30, 5), Wait().limit(30, None)) == (2, 5, 30)
    assert (Skip().limit(30, None), Raise().limit(30, 2), Retry().limit(30, None)) == (0, 2, 0)
    with pytest.raises(ValueError, match="countdown"):
        resolve("skip", **options(countdown=-1))  # checked for every alias, as before
    with pytest.raises(TypeError, match="Retry"):
        locked_task("x", on_contention=Retry(), countdown=5)
    with pytest.raises(TypeError, match="max_retries"):
        locked_task("x", on_contention=Skip(), max_retries=2)
    with pytest.raises(TypeError, match="own timeout"):
        locked_task("x", on_contention=Wait(1), timeout=2)
    with pytest.raises(TypeError, match="on_contention"):
        locked_task("x", on_contention=Skip)  # the class, not a policy
    with pytest.raises(ValueError, match="on_contention"):
        locked_task("x", on_contention="Skip")
    assert isinstance(Wait(), ContentionPolicy)
    locked_task("x", on_contention=Wait(), timeout=2)  # one timeout: fine


def test_visibility_timeout_of_brokers_and_the_warning(caplog):
    redis_app = Celery("vt", broker="redis://127.0.0.1:1/0", set_as_current=False)
    assert visibility_timeout(redis_app) == 3600
    redis_app.conf.broker_transport_options = {"visibility_timeout": 10}
    assert visibility_timeout(redis_app) == 10
    assert visibility_timeout(Celery("fs", broker="filesystem://", set_as_current=False)) is None

    @redis_app.task(bind=True, name="tests.long_ttl")
    @locked_task("test:{key}", ttl=60, on_contention="raise")
    def long_ttl(self, key, *, lease):
        return lease.token

    with caplog.at_level(logging.WARNING, logger="distlock.integrations.celery"):
        token = long_ttl("vt")  # runs the body here: only the warning is under test
    assert token >= 1 and Lock.objects.get(name="test:vt").is_free
    assert "longer than the broker visibility timeout 10 s" in caplog.text


# --- with a real worker ----------------------------------------------------------------


def test_same_key_tasks_never_overlap_and_tokens_increase(celery):
    k = key()
    ids = [hold_wait.delay(k, 0.3).id for _ in range(6)]
    ends = celery.events.wait(6, kind="end", key=k, timeout=60)
    starts = sorted(celery.events.all(kind="start", key=k), key=lambda e: e["token"])
    assert sorted(e["task_id"] for e in starts) == sorted(ids)
    tokens = [e["token"] for e in starts]
    assert tokens == list(range(tokens[0], tokens[0] + 6))
    end_of = {e["token"]: e["db_us"] for e in ends}
    for earlier, later in zip(starts, starts[1:], strict=False):
        # Granted only after the previous holder finished its body (and released).
        assert later["acquired_us"] >= end_of[earlier["token"]]
    assert all(e["current"] for e in starts)  # current_lease() is the injected lease
    assert len({e["pid"] for e in starts}) == 2  # both pool children took part
    released(f"test:{k}")


def test_skip_does_not_run_the_body_and_says_so(celery):
    k = key()
    held = acquire(f"test:{k}", ttl=30)
    skipped = hold_skip.delay(k).id
    busy = celery.events.wait(kind="busy", task_id=skipped)
    assert busy[0]["policy"] == "skip" and busy[0]["name"] == f"test:{k}"
    assert held.release() is True
    ran = hold_skip.delay(k).id
    celery.events.wait(kind="end", task_id=ran)
    assert celery.events.all(kind="start", task_id=skipped) == []
    assert "skipped, the task did not run" in celery.worker.tail(200)


def test_retry_retries_with_countdown_then_runs_with_a_higher_token(celery):
    k = key()
    held = acquire(f"test:{k}", ttl=30)
    task_id = hold_retry.delay(k).id
    busy = celery.events.wait(3, kind="busy", task_id=task_id)
    assert [e["retries"] for e in busy[:3]] == [0, 1, 2]
    assert all(e["policy"] == "retry" and 0.2 <= e["countdown"] <= 0.3 for e in busy)
    assert held.release() is True
    start = celery.events.wait(kind="start", task_id=task_id)[0]
    assert start["retries"] >= 3 and start["token"] > held.token
    celery.events.wait(kind="end", task_id=task_id)


def test_retry_gives_up_after_max_retries(celery):
    k = key()
    held = acquire(f"test:{k}", ttl=30)
    task_id = hold_retry_once.delay(k).id
    failed = celery.events.wait(kind="failed", task_id=task_id)[0]
    assert failed["error"] == LockContended.__name__
    assert [e["retries"] for e in celery.events.all(kind="busy", task_id=task_id)] == [0, 1]
    assert celery.events.all(kind="start", task_id=task_id) == []
    assert held.release() is True


def test_wait_gets_the_lock_when_the_holder_expires(celery):
    k = key()
    held = acquire(f"test:{k}", ttl=1.5)  # never released: it must expire
    task_id = hold_wait.delay(k).id
    start = celery.events.wait(kind="start", task_id=task_id)[0]
    assert start["token"] == held.token + 1
    assert start["acquired_us"] >= us(held.expires_at)
    celery.events.wait(kind="end", task_id=task_id)
    assert held.release() is False


def test_wait_is_bounded_and_raise_raises(celery):
    k = key()
    held = acquire(f"test:{k}", ttl=30)
    waited = hold_wait_short.delay(k).id
    raised = hold_raise.delay(k).id
    failed = {e["task_id"]: e for e in celery.events.wait(2, kind="failed",
                                                             where=lambda e: e["task_id"] in
                                                             (waited, raised))}
    assert failed[waited]["error"] == "LockTimeout"
    assert failed[raised]["error"] == "LockContended"
    policies = {e["task_id"]: e["policy"] for e in celery.events.all(kind="busy")}
    assert policies[waited] == "wait" and policies[raised] == "raise"
    assert held.release() is True


def test_policy_objects_skip_and_raise(celery):
    k = key()
    held = acquire(f"test:{k}", ttl=30)
    skipped, raised = obj_skip.delay(k).id, obj_raise.delay(k).id
    failed = celery.events.wait(kind="failed", task_id=raised)[0]
    assert failed["error"] == "LockContended"
    busy = celery.events.wait(kind="busy", task_id=skipped)[0]
    assert busy["policy"] == "skip" and busy["name"] == f"test:{k}"
    assert celery.events.all(kind="busy", task_id=raised)[0]["policy"] == "raise"
    assert held.release() is True
    ran = obj_skip.delay(k).id
    celery.events.wait(kind="end", task_id=ran)
    assert celery.events.all(kind="start", task_id=skipped) == []
    assert celery.events.all(kind="start", task_id=raised) == []


def test_policy_object_retry_retries_then_runs_or_gives_up(celery):
    k, once = key(), key()
    held = acquire(f"test:{k}", ttl=30)
    held_once = acquire(f"test:{once}", ttl=30)
    task_id = obj_retry.delay(k).id
    gives_up = obj_retry_once.delay(once).id
    busy = celery.events.wait(2, kind="busy", task_id=task_id)
    assert [e["retries"] for e in busy[:2]] == [0, 1]
    assert all(e["policy"] == "retry" and 0.2 <= e["countdown"] <= 0.3 for e in busy)
    assert held.release() is True
    start = celery.events.wait(kind="start", task_id=task_id)[0]
    assert start["retries"] >= 2 and start["token"] > held.token
    failed = celery.events.wait(kind="failed", task_id=gives_up)[0]
    assert failed["error"] == LockContended.__name__
    tries = celery.events.all(kind="busy", task_id=gives_up)
    assert [(e["retries"], e["countdown"]) for e in tries] == [(0, 0.1), (1, 0.1)]
    assert celery.events.all(kind="start", task_id=gives_up) == []
    assert held_once.release() is True
    celery.events.wait(kind="end", task_id=task_id)


def test_policy_object_wait_is_bounded_or_gets_the_expired_lock(celery):
    k, short = key(), key()
    expiring = acquire(f"test:{k}", ttl=1.5)  # never released: it must expire
    held = acquire(f"test:{short}", ttl=30)
    waited = obj_wait.delay(k).id
    gave_up = obj_wait_short.delay(short).id
    failed = celery.events.wait(kind="failed", task_id=gave_up)[0]
    assert failed["error"] == "LockTimeout"
    assert celery.events.all(kind="busy", task_id=gave_up)[0]["policy"] == "wait"
    start = celery.events.wait(kind="start", task_id=waited)[0]
    assert start["token"] == expiring.token + 1
    assert start["acquired_us"] >= us(expiring.expires_at)
    celery.events.wait(kind="end", task_id=waited)
    assert celery.events.all(kind="busy", task_id=waited) == []
    assert expiring.release() is False and held.release() is True


def test_auto_renew_keeps_a_long_task_holding_past_its_ttl(celery):
    k = key()
    name = f"test:{k}"
    task_id = hold_renewed.delay(k, -1).id  # holds until the go file, with a 1.5 s ttl
    start = celery.events.wait(kind="start", task_id=task_id)[0]
    give_up = start["expires_us"] + 10_000_000
    while Lock.objects.get(name=name).renew_count < 4:  # renewed every 0.5 s
        assert db_now_us("default") < give_up, "the lease was not renewed"
        time.sleep(0.05)
    assert db_now_us("default") > start["expires_us"]  # past the ttl it was granted...
    assert acquire(name, ttl=1, blocking=False) is None  # ...and still held
    row = Lock.objects.get(name=name)
    assert row.token == start["token"] and row.expires_us > start["expires_us"]
    celery.go(k)
    end = celery.events.wait(kind="end", task_id=task_id)[0]
    assert end["token"] == start["token"] and end["db_us"] > start["expires_us"]
    released(name)


def test_a_retried_task_releases_and_gets_a_higher_token(celery):
    k = key()
    task_id = retry_self.delay(k).id
    end = celery.events.wait(kind="end", task_id=task_id)[0]
    first, second = celery.events.all(kind="start", task_id=task_id)
    assert (first["retries"], second["retries"]) == (0, 1)
    # The retry was queued while the first run still held the lock; with "skip" it would
    # have been dropped had it not waited for its own previous run's release.
    assert second["token"] == first["token"] + 1 and first["owner"] != second["owner"]
    assert celery.events.all(kind="busy", task_id=task_id) == []
    assert released(f"test:{k}").token == end["token"]


def test_a_retried_run_tries_once_more_when_its_previous_run_released_after_its_try(celery):
    """The retried run's busy try meets its own previous run's lease; that run releases
    *before* the retried run decides (the try waits at the test's gate meanwhile). The
    lock is free then: the retried run tries once more and gets it, it is not contended.
    """
    k = key()
    name = f"gated:{k}"
    task_id = retry_gated.delay(k).id
    first = celery.events.wait(kind="start", task_id=task_id)[0]
    busy_try = celery.events.wait(kind="busy_try", task_id=task_id)[0]
    assert (first["retries"], busy_try["retries"]) == (0, 1)
    assert Lock.objects.get(name=name).owner == first["owner"]  # the try met the first run
    celery.go(k)  # the first run leaves its body and releases...
    assert released(name).token == first["token"]
    (celery.base / f"gate-{k}").touch()  # ...and only then the retried run goes on
    outcome = celery.events.wait(
        task_id=task_id, where=lambda e: e["kind"] == "busy" or e["kind"] == "end")[0]
    assert outcome["kind"] == "end", f"the retried run was called contended: {outcome}"
    second = celery.events.all(kind="start", task_id=task_id)[1]
    assert second["retries"] == 1 and second["token"] == first["token"] + 1
    assert celery.events.all(kind="busy", task_id=task_id) == []
    released(name)


def test_a_lock_timeout_of_the_body_fails_the_task_and_is_not_contention(celery):
    """The body's own lock times out: that LockTimeout fails the task as the body's error;
    the decorator's policy (skip) is not applied, and the task's lock is released."""
    k = key()
    inner = acquire(f"test:{k}:inner", ttl=30)
    try:
        task_id = inner_times_out.delay(k).id
        outcome = celery.events.wait(
            task_id=task_id, where=lambda e: e["kind"] in ("failed", "busy"))[0]
    finally:
        assert inner.release() is True
    assert outcome["kind"] == "failed", f"the body's timeout was called contention: {outcome}"
    assert outcome["error"] == "LockTimeout" and f"test:{k}:inner" in outcome["message"]
    assert celery.events.all(kind="busy", task_id=task_id) == []
    assert celery.events.all(kind="end", task_id=task_id) == []
    start = celery.events.all(kind="start", task_id=task_id)[0]
    assert_freed_by_release(f"test:{k}", start)


def test_a_task_whose_body_raises_releases_its_lock_at_once(celery):
    k = key()
    task_id = fail.delay(k).id
    failed = celery.events.wait(kind="failed", task_id=task_id)[0]
    assert failed["error"] == "RuntimeError" and "the body failed" in failed["message"]
    start = celery.events.all(kind="start", task_id=task_id)[0]
    assert_freed_by_release(f"test:{k}", start)


def test_unbound_task_with_a_callable_name_sees_current_lease(celery):
    k = key()
    unbound.delay(k)
    event = celery.events.wait(kind="unbound", key=k)[0]
    assert event["token"] == Lock.objects.get(name=f"test:{k}").token
    assert current_lease() is None


def test_acks_late_duplicate_while_the_first_copy_runs_cannot_enter(celery):
    """A second delivery of the same message (same task id) meets the first copy's lock.

    On the filesystem broker a redelivery is made by sending the message again with the
    same id, which is what the broker does; the Redis variant below waits for a real
    visibility-timeout redelivery.
    """
    k = key()
    first = late_skip.delay(k)
    start = celery.events.wait(kind="start", task_id=first.id)[0]
    late_skip.apply_async((k,), task_id=first.id)
    busy = celery.events.wait(kind="busy", task_id=first.id)[0]
    celery.go(k)
    end = celery.events.wait(kind="end", task_id=first.id)[0]
    assert len(celery.events.all(kind="start", task_id=first.id)) == 1
    assert start["db_us"] < busy["db_us"] < end["db_us"]
    assert busy["policy"] == "skip"


@pytest.mark.skipif(not REDIS, reason="visibility-timeout redelivery needs Redis")
def test_redis_visibility_timeout_redelivery_cannot_enter(celery):
    queue = f"{celery.queue}-vt"
    worker = Worker(celery.base, queue, visibility=2)
    try:
        worker.wait_ready()
        k = key()
        first = late_skip.apply_async((k,), queue=queue)
        start = celery.events.wait(kind="start", task_id=first.id)[0]
        busy = celery.events.wait(kind="busy", task_id=first.id, timeout=30)[0]
        assert busy["redelivered"] is True and busy["policy"] == "skip"
        celery.go(k)
        end = celery.events.wait(kind="end", task_id=first.id)[0]
        assert len(celery.events.all(kind="start", task_id=first.id)) == 1
        assert start["db_us"] < busy["db_us"] < end["db_us"]
    finally:
        worker.stop()
        drop_queue(queue)


def test_sigkilled_child_frees_the_lock_at_its_ttl_and_the_task_runs_once(celery):
    k = key()
    task_id = killable.delay(k).id
    first = celery.events.wait(kind="start", task_id=task_id)[0]
    # The pool child running the task: a process of the worker this test started.
    os.kill(first["pid"], signal.SIGKILL)
    celery.go(k)
    end = celery.events.wait(kind="end", task_id=task_id, timeout=60)[0]
    starts = celery.events.all(kind="start", task_id=task_id)
    assert len(starts) == 2
    second = starts[1]
    assert second["pid"] != first["pid"]
    assert second["token"] == first["token"] + 1
    # The dead holder's lease was not released: the requeued copy got it at its expiry.
    assert second["acquired_us"] >= first["expires_us"]
    assert end["token"] == second["token"]
    assert len(celery.events.all(kind="end", task_id=task_id)) == 1
    released(f"test:{k}")
