"""A Celery task killed by its hard time limit (tests/test_celery_faults.py).

Registered on the test suite's Celery app (tests/support/celery_app.py), so a worker started with
``celery -A tests.stress.celery_tasks worker`` runs it beside the suite's own tasks and
records events into the same events.jsonl.
"""

from __future__ import annotations

import time
from typing import Any

from distlock.integrations.celery import locked_task
from tests.support.celery_app import _lease_event, app, base_dir

__all__ = ["app", "time_limited"]

HARD_LIMIT = 2.0
TTL = 4.0


@app.task(
    bind=True, name="tests.stress.time_limited", acks_late=True, time_limit=HARD_LIMIT,
    # A hard time limit then rejects the message with requeue instead of acking it:
    # the task is redelivered, not dropped.
    acks_on_timeout=False,
)
@locked_task("test:{key}", ttl=TTL, on_contention="wait", timeout=60)
def time_limited(self: Any, key: str, *, lease: Any) -> int:
    """First run: overrun the hard time limit (Celery SIGKILLs the pool child while it
    holds the lease). The redelivered run finds the marker and finishes at once."""
    _lease_event("start", self, key, lease)
    marker = base_dir() / f"overran-{key}"
    if not marker.exists():
        marker.touch()
        time.sleep(10 * HARD_LIMIT)
    _lease_event("end", self, key, lease)
    return lease.token
