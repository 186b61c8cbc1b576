"""The Django Tasks tasks of tests/test_tasks.py, run by real ``db_worker`` processes.

The test process imports this module to enqueue; each worker imports it (by the task's
module path) to run them. The framework is Django 6's ``django.tasks`` or, on 5.2, the
``django-tasks`` backport (tests/settings.py). Tasks on the ``default`` backend go to the
database backend (django-tasks-db); those on ``immediate`` run in the caller.

Every task read-modify-writes ``Counter(key).value`` under lock ``counter:{key}`` with a
fenced write, so an overlap of two holders shows as a lost update or a refused write.
With DISTLOCK_TEST_TASKS_DIR set (the workers the tests start), the tasks record what
happened in that folder (tests/support/events.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from importlib import import_module
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.dispatch import receiver

from distlock import alock, current_lease, lock
from distlock.integrations.tasks import (
    FRAMEWORK,
    Raise,
    Retry,
    Skip,
    Wait,
    locked_task,
    task_lock_busy,
)
from tests.support import events
from tests.support.helpers import us
from tests.testapp.models import Counter

task = import_module(FRAMEWORK).task
Task = import_module(f"{FRAMEWORK}.base").Task
DIR_ENV = "DISTLOCK_TEST_TASKS_DIR"


def base_dir() -> Path:
    return Path(os.environ[DIR_ENV])


def record(kind: str, **data: Any) -> None:
    """Record an event, when a test collects them (DISTLOCK_TEST_TASKS_DIR is set)."""
    if os.environ.get(DIR_ENV):
        events.record(base_dir(), kind, **data)


def _deposit(key: str, seconds: float, lease: Any, task_id: str | None,
             retries: int = 0) -> int:
    """The body of the contending tasks: read, hold ``seconds``, write read + 1 fenced.

    ``seconds`` < 0 holds until the test creates the go file ``go-<key>``.
    """
    fields = {
        "task_id": task_id, "key": key, "token": lease.token, "owner": lease.owner,
        "holder": lease.holder, "retries": retries, "current": current_lease() is lease,
    }
    record("start", acquired_us=us(lease.acquired_at), expires_us=us(lease.expires_at), **fields)
    read = Counter.objects.get(key=key).value
    if seconds < 0:
        events.wait_for_file(base_dir() / f"go-{key}")
    else:
        time.sleep(seconds)
    Counter.objects.filter(key=key).fenced_update(lease, value=read + 1)
    record("end", read=read, **fields)
    return int(lease.token)


# Tasks that take the context: their result id comes from it.


@task(takes_context=True)
@locked_task("counter:{key}", ttl=30, on_contention="wait", timeout=30)
def hold_wait(context: Any, key: str, seconds: float = 0.0, *, lease: Any) -> int:
    return _deposit(key, seconds, lease, context.task_result.id)


@task(takes_context=True)
@locked_task("counter:{key}", ttl=30, on_contention=Wait(0.5))
def hold_wait_short(context: Any, key: str, *, lease: Any) -> int:
    return _deposit(key, 0, lease, context.task_result.id)


@task(takes_context=True)
@locked_task("counter:{key}", ttl=30, on_contention=Skip())
def hold_skip(context: Any, key: str, *, lease: Any) -> int:
    return _deposit(key, 0, lease, context.task_result.id)


@task(takes_context=True)
@locked_task("counter:{key}", ttl=30, on_contention="raise")
def hold_raise(context: Any, key: str, *, lease: Any) -> int:
    return _deposit(key, 0, lease, context.task_result.id)


@task(takes_context=True)
@locked_task("counter:{key}", ttl=30, on_contention=Raise())
def fail(context: Any, key: str, *, lease: Any) -> None:
    """The body raises: the lock must be released then, not left to run out its ttl."""
    record("start", task_id=context.task_result.id, key=key, token=lease.token,
           expires_us=us(lease.expires_at))
    raise RuntimeError(f"the body failed holding token {lease.token}")


@task(takes_context=True)
@locked_task("counter:{key}", ttl=1.5, on_contention="wait", timeout=30)
def killable(context: Any, key: str, seconds: float = -1, *, lease: Any) -> int:
    """Holds until the go file: the test SIGKILLs or SIGSTOPs its worker meanwhile."""
    return _deposit(key, seconds, lease, context.task_result.id)


@task(takes_context=True)
@locked_task("counter:{key}", ttl=30, on_contention=Skip())
def inner_times_out(context: Any, key: str, *, lease: Any) -> None:
    """The body takes a second lock, ``counter:<key>:inner`` (the test holds it), with a
    timeout: its LockTimeout is the body's failure, not contention for ``counter:<key>``."""
    task_id = context.task_result.id
    record("start", task_id=task_id, key=key, token=lease.token,
           expires_us=us(lease.expires_at))
    with lock(f"counter:{key}:inner", ttl=30, timeout=0.2):
        record("end", task_id=task_id, key=key)


@task(takes_context=True)
@locked_task("counter:{key}", ttl=30, on_contention=Skip())
async def inner_times_out_async(context: Any, key: str, *, lease: Any) -> None:
    """inner_times_out as an ``async def`` task (run under alock)."""
    task_id = context.task_result.id
    await sync_to_async(record)("start", task_id=task_id, key=key, token=lease.token,
                                expires_us=us(lease.expires_at))
    async with alock(f"counter:{key}:inner", ttl=30, timeout=0.2):
        await sync_to_async(record)("end", task_id=task_id, key=key)


# Without the context: the run finds its own result through the task_started signal
# (distlock.integrations.tasks._running), which a requeue needs.


@task()
@locked_task("counter:{key}", ttl=30, on_contention=Retry(0.2, jitter=0.1, max_retries=50))
def hold_retry(key: str, *, lease: Any) -> int:
    return _deposit(key, 0, lease, None)


@task()
@locked_task("counter:{key}", ttl=30, on_contention="retry", countdown=0.1, jitter=False,
             max_retries=1)
def hold_retry_once(key: str, *, lease: Any) -> int:
    return _deposit(key, 0, lease, None)


# On the immediate backend (run in the caller, for the in-process tests).


@task(backend="immediate")
@locked_task("counter:{key}", ttl=30, on_contention="retry")
def now_retry(key: str, *, lease: Any) -> int:
    return int(lease.token)


@task(backend="immediate", takes_context=True)
@locked_task("counter:{key}", ttl=30, on_contention="skip")
def now_skip(context: Any, key: str, *, lease: Any) -> dict[str, Any]:
    return {"token": lease.token, "holder": lease.holder, "current": current_lease() is lease,
            "attempt": context.attempt}


@task(backend="immediate")
@locked_task(lambda key, pause=0.0: f"counter:{key}", ttl=30, on_contention="raise")
def now_named(key: str, pause: float = 0.0) -> int | None:
    """No ``lease`` parameter, the name from a callable: current_lease() has it."""
    lease = current_lease()
    return None if lease is None else int(lease.token)


@task(backend="immediate")
@locked_task("counter:{key}", ttl=30, on_contention="raise")
def now_fail(key: str, *, lease: Any) -> None:
    raise RuntimeError(f"the body failed holding token {lease.token}")


# async def tasks: run under alock.


async def _adeposit(key: str, seconds: float, lease: Any, task_id: str | None) -> int:
    """_deposit in async code: async ORM and fenced write, events through the sync layer."""
    fields = {
        "task_id": task_id, "key": key, "token": lease.token, "owner": lease.owner,
        "holder": lease.holder, "current": current_lease() is lease, "run": "async",
    }
    await sync_to_async(record)(
        "start", acquired_us=us(lease.acquired_at), expires_us=us(lease.expires_at), **fields,
    )
    read = (await Counter.objects.aget(key=key)).value
    await asyncio.sleep(seconds)
    await Counter.objects.filter(key=key).afenced_update(lease, value=read + 1)
    await sync_to_async(record)("end", read=read, **fields)
    return int(lease.token)


@task(takes_context=True)
@locked_task("counter:{key}", ttl=30, on_contention="wait", timeout=30)
async def hold_async(context: Any, key: str, seconds: float = 0.0, *, lease: Any) -> int:
    return await _adeposit(key, seconds, lease, context.task_result.id)


@task()
@locked_task("counter:{key}", ttl=30, on_contention=Retry(0.2, jitter=0.1, max_retries=50))
async def retry_async(key: str, *, lease: Any) -> int:
    return await _adeposit(key, 0, lease, None)


@task(backend="immediate")
@locked_task("counter:{key}", ttl=30, on_contention="skip")
async def now_async(key: str, *, lease: Any) -> dict[str, Any]:
    return {"token": lease.token, "current": current_lease() is lease}


@receiver(task_lock_busy)
def _busy(sender: Any, name: str, policy: str, task_id: str | None, retries: int,
          countdown: float | None, **kwargs: Any) -> None:
    if not isinstance(sender, Task):
        return  # a Celery task (tests/support/celery_app.py) in the same process
    record("busy", task_id=task_id, name=name, policy=policy, retries=retries,
           countdown=countdown, sender=getattr(sender, "name", None))


def _finished(sender: Any, task_result: Any, **kwargs: Any) -> None:
    errors = [error.exception_class_path for error in task_result.errors]
    record("finished", task_id=task_result.id, status=str(task_result.status), errors=errors,
           kwargs=task_result.kwargs)


import_module(f"{FRAMEWORK}.signals").task_finished.connect(_finished)
