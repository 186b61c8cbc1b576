"""The contending Celery task: a deposit (deposits.py) under the account's lock.

A fenced write refused as stale is retried with Celery's own retry: the retry releases,
waits for the lock again and gets a higher token.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from celery import shared_task, signals
from django.conf import settings

from demo_project.bank import deposits
from distlock import StaleToken
from distlock.core.leases import Lease
from distlock.integrations.celery import locked_task

# When each task started in this process (before it waited for the lock), by task id.
_started: dict[str, float] = {}


@signals.task_prerun.connect
def _task_started(task_id: str | None = None, **kwargs: Any) -> None:
    if task_id:
        _started[task_id] = time.monotonic()


@shared_task(bind=True, max_retries=20)
@locked_task(
    "account:{account_id}", ttl=settings.DEMO_LOCK_TTL, on_contention="wait", timeout=120,
)
def deposit(
    self: Any, run: str, mode: str, account_id: int, task_no: int, work: float,
    base_token: int, pause_grants: list[int], pause_max: float, *, lease: Lease,
) -> str:
    """Add 1 to the balance (deposits.deposit); ``mode`` is "fenced" or "unfenced"."""
    by = deposits.Run(
        retry=self.request.retries, worker=self.request.hostname or socket.gethostname(),
        waited=time.monotonic() - _started.pop(self.request.id, time.monotonic()),
    )
    try:
        return deposits.deposit(
            run, mode, account_id, task_no, work, base_token, pause_grants, pause_max,
            lease, by,
        )
    except StaleToken:
        raise self.retry(countdown=0) from None
