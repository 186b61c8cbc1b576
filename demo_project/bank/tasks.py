"""The contending task: deposit 1 into an account by read-modify-write under a lock.

The read-modify-write (read the balance, work, write balance + 1) is on purpose: it is
the shape of real critical sections (compute from what you read, then store), and it is
what loses updates when two holders overlap. The lock is supposed to prevent overlap;
a holder that stalls past its lease (a GC pause, a VM migration, a swapped-out process)
breaks that, and only fencing makes the database notice.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from celery import shared_task, signals
from django.conf import settings

from demo_project.bank.models import Account, Attempt
from distlock import StaleToken
from distlock.celery import locked_task
from distlock.leases import Lease

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
    """Add 1 to the balance. ``mode`` is "fenced" or "unfenced".

    The grant numbered ``lease.token - base_token`` pauses if it is in ``pause_grants``:
    after reading, it stalls until its lease has expired *and* the next holder has read
    the balance (at most ``pause_max`` s). That is the seed's worst case made certain
    rather than likely, so every run shows it. A fenced write refused as stale is retried:
    the retry releases, waits for the lock again and gets a higher token.
    """
    waited = time.monotonic() - _started.pop(self.request.id, time.monotonic())
    read = Account.objects.get(pk=account_id).balance
    attempt = Attempt.objects.create(
        run=run, mode=mode, account_id=account_id, task_no=task_no,
        retry=self.request.retries, token=lease.token,
        worker=self.request.hostname or socket.gethostname(), pid=os.getpid(),
        waited=waited, read_balance=read,
    )
    time.sleep(work)
    if lease.token - base_token in pause_grants:
        attempt.paused, attempt.taken_over_by = _stall(attempt, lease, pause_max)
        attempt.save(update_fields=["paused", "taken_over_by"])
    try:
        if mode == "fenced":
            Account.objects.filter(pk=account_id).fenced_update(lease, balance=read + 1)
        else:
            Account.objects.filter(pk=account_id).update(balance=read + 1)
    except StaleToken as exc:
        attempt.outcome, attempt.detail = Attempt.Outcome.REFUSED, str(exc)[:500]
        attempt.save(update_fields=["outcome", "detail"])
        raise self.retry(countdown=0) from None
    attempt.outcome, attempt.wrote_balance = Attempt.Outcome.WRITTEN, read + 1
    # Did it still hold the lock when it wrote? (The unfenced stale holder does not know.)
    attempt.lease_still_held = lease.remaining() > 0 and attempt.taken_over_by is None
    attempt.save(update_fields=["outcome", "wrote_balance", "lease_still_held"])
    return attempt.outcome


def _stall(attempt: Attempt, lease: Lease, limit: float) -> tuple[float, int | None]:
    """Sleep until the lock has a newer holder that has read the balance, or ``limit``."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        newer = (
            Attempt.objects.filter(run=attempt.run, mode=attempt.mode, token__gt=lease.token)
            .order_by("token").values_list("token", flat=True).first()
        )
        if newer is not None:
            return time.monotonic() - started, newer
        time.sleep(0.05)
    return time.monotonic() - started, None
