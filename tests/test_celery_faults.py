"""S3: a Celery task killed by its hard time limit while it holds the lock.

Celery's hard ``time_limit`` SIGKILLs the pool child, which to the lock is the same as an
OOM kill: the lease is not released and runs out at its ttl. With ``acks_late`` and
``acks_on_timeout=False`` the message is requeued. The redelivered copy must wait for
the dead holder's lease (``on_contention="wait"``), then run exactly once with a higher
token; the kill is reported as a task failure, never dropped silently.

A real ``celery worker`` (prefork, 2 children) on the suite's broker (filesystem, or Redis
when configured); the task is sent from a separate process so that this module never
reconfigures the Celery app the other Celery tests use in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from distlock.models import Lock
from tests.stress.celery_tasks import HARD_LIMIT, TTL
from tests.stress.harness import HISTORY, drop_triggers, install_triggers, rows
from tests.support.celery_app import DIR_ENV, QUEUE_ENV, broker_url
from tests.support.celery_workers import Worker
from tests.support.events import Events
from tests.support.helpers import wait_until
from tests.support.processes import ROOT

pytestmark = [pytest.mark.processes, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def time_limit_worker(base, queue) -> Worker:
    """The suite's Worker, loading the module that defines the time-limited task."""
    return Worker(base, queue, app="tests.stress.celery_tasks", name="distlock-tl")


def send(base, queue: str, key: str) -> str:
    """Send the task from a child process (configured by the environment); its id."""
    code = (
        "from tests.stress.celery_tasks import time_limited\n"
        f"print(time_limited.delay({key!r}).id)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT),
             DIR_ENV: str(base), QUEUE_ENV: queue},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_hard_time_limit_kill_is_redelivered_waits_for_the_lease_and_runs_once(tmp_path):
    base = tmp_path / "celery"
    base.mkdir()
    if broker_url() == "filesystem://":
        for sub in ("queue", "control", "tmp"):
            (base / sub).mkdir()
    queue = f"distlock-tl-{uuid.uuid4().hex[:8]}"
    install_triggers()  # the lock table's grants and releases, logged by the database
    worker = time_limit_worker(base, queue)
    events = Events(base)
    try:
        worker.wait_ready()
        k = uuid.uuid4().hex[:12]
        task_id = send(base, queue, k)
        first = events.wait(kind="start", task_id=task_id, timeout=60)[0]
        failed = events.wait(kind="failed", task_id=task_id, timeout=60)[0]
        assert failed["error"] == "TimeLimitExceeded", failed
        end = events.wait(kind="end", task_id=task_id, timeout=60)[0]
        starts = events.all(kind="start", task_id=task_id)
        assert len(starts) == 2, starts
        second = starts[1]
        assert second["pid"] != first["pid"], "the killed child cannot have run it again"
        assert second["token"] == first["token"] + 1
        # Billiard ends a child over its hard limit with SIGTERM, then SIGKILL 0.1 s later
        # if it still lives: the first lease ended either by a release during SIGTERM's
        # unwinding or at its expiry, and the redelivered grant came after that end.
        ends = [row for row in rows(HISTORY) if row["token"] == first["token"]
                and row["kind"] == "end"]
        first_end = min([first["expires_us"], *(row["at_us"] for row in ends)])
        assert second["acquired_us"] >= first_end, "the redelivered copy overlapped the first"
        # (MariaDB reads SYSDATE(6) twice in the grant: a few µs more, never less.)
        assert 0 <= first["expires_us"] - first["acquired_us"] - int(TTL * 1e6) < 1000
        assert failed["db_us"] - first["acquired_us"] >= HARD_LIMIT * 1e6 * 0.9
        assert end["token"] == second["token"]
        assert len(events.all(kind="end", task_id=task_id)) == 1
        # The task records "end" just before its release: wait for the release to land.
        wait_until(lambda: Lock.objects.get(name=f"test:{k}").is_free, 10,
                   "the lock freed after the redelivered run")
        assert "Hard time limit" in worker.tail(200)
    finally:
        worker.stop()
        drop_triggers()
