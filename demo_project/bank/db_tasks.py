"""The contending task for Django's Tasks framework (``contention_demo --django-tasks``):
the same deposit (deposits.py) under the same lock, run by django-tasks-db's
``db_worker`` processes instead of Celery workers.

A fenced write refused as stale is retried by enqueueing the deposit again (Django Tasks
has no retry of its own): the new run waits for the lock and gets a higher token.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from django.conf import settings
from django.utils import timezone

from demo_project.bank import deposits
from distlock import StaleToken
from distlock.core.leases import Lease
from distlock.integrations.tasks import FRAMEWORK, locked_task

task = import_module(FRAMEWORK).task


@task(takes_context=True)
@locked_task(
    "account:{account_id}", ttl=settings.DEMO_LOCK_TTL, on_contention="wait", timeout=120,
)
def deposit(
    context: Any, run: str, mode: str, account_id: int, task_no: int, work: float,
    base_token: int, pause_grants: list[int], pause_max: float, retry: int = 0, *,
    lease: Lease,
) -> str:
    """Add 1 to the balance (deposits.deposit); ``mode`` is "fenced" or "unfenced"."""
    result = context.task_result
    by = deposits.Run(
        retry=retry, worker=result.worker_ids[-1],
        # The worker claimed the task (started_at) before it waited for the lock.
        waited=(timezone.now() - result.started_at).total_seconds(),
    )
    args = (run, mode, account_id, task_no, work, base_token, pause_grants, pause_max)
    try:
        return deposits.deposit(*args, lease, by)
    except StaleToken:
        # The same task on the same queue (result.task), queued again.
        result.task.enqueue(*args, retry=retry + 1)
        return "refused"
