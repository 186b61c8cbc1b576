"""The Django Tasks task of tests/test_unique_tasks.py, and the child that enqueues it.

``unique_body`` is run by real ``db_worker`` processes (tests/support/task_workers.py);
with DISTLOCK_TEST_TASKS_DIR set it records its start and end there (tests/support/events.py)
and, given ``hold``, waits for the test's go file ``go-<key>`` in between.
``enqueuer`` is a child process (tests/support/processes.py, role
``tests.support.unique_tasks:enqueuer``) that enqueues one key many times.
"""

from __future__ import annotations

from importlib import import_module

from distlock.integrations.tasks import FRAMEWORK, enqueue_once, unique_task
from tests.support import events
from tests.support.tasks import base_dir, record
from tests.support.worker import command, emit

task = import_module(FRAMEWORK).task


@task()
@unique_task
def unique_body(key: str, n: int, hold: bool = False) -> int:
    """Record the run (``n``: which enqueue sent it); with ``hold``, wait for the go file."""
    record("unique_start", key=key, n=n)
    if hold:
        events.wait_for_file(base_dir() / f"go-{key}")
    record("unique_end", key=key, n=n)
    return n


def enqueuer(key: str, count: int, queue: str) -> None:
    """On the test's command, enqueue ``key`` ``count`` times on ``queue`` (which no worker
    takes: the test counts the tasks sent); report how many calls sent one."""
    emit("ready")
    command()
    queued = unique_body.using(queue_name=queue)
    sent = sum(
        enqueue_once(key, queued, [key, n], policy="queued", ttl=60) for n in range(count)
    )
    emit("done", sent=sent)
