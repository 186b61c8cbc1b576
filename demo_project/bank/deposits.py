"""The demo's critical section: deposit 1 into an account by read-modify-write.

The read-modify-write (read the balance, work, write balance + 1) is on purpose: it is
the shape of real critical sections (compute from what you read, then store), and it is
what loses updates when two holders overlap. The lock is supposed to prevent overlap;
a holder that stalls past its lease (a GC pause, a VM migration, a swapped-out process)
breaks that, and only fencing makes the database notice.

One body for both task runners of the demo: Celery (tasks.py) and Django's Tasks
framework (db_tasks.py); each wraps it in its own task and retries a refused write its
own way.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from demo_project.bank.models import Account, Attempt
from distlock import StaleToken
from distlock.core.leases import Lease
from distlock.db import db_now_us


@dataclass(frozen=True)
class Run:
    """Who runs this deposit, for the report: retry count, worker, seconds waited."""

    retry: int
    worker: str
    waited: float


def deposit(
    run: str, mode: str, account_id: int, task_no: int, work: float, base_token: int,
    pause_grants: list[int], pause_max: float, lease: Lease, by: Run,
) -> str:
    """Add 1 to the balance. ``mode`` is "fenced" or "unfenced".

    The grant numbered ``lease.token - base_token`` pauses if it is in ``pause_grants``:
    after reading, it stalls until its lease has expired *and* the next holder has read
    the balance (at most ``pause_max`` s). That is the seed's worst case made certain
    rather than likely, so every run shows it. A fenced write refused as stale raises
    StaleToken (after recording it); the caller queues the deposit again, which waits for
    the lock again and gets a higher token.
    """
    read = Account.objects.get(pk=account_id).balance
    attempt = Attempt.objects.create(
        run=run, mode=mode, account_id=account_id, task_no=task_no, retry=by.retry,
        token=lease.token, worker=by.worker, pid=os.getpid(), waited=by.waited,
        read_balance=read,
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
        attempt.wrote_us = db_now_us(lease.using)
        attempt.save(update_fields=["outcome", "detail", "wrote_us"])
        raise
    attempt.outcome, attempt.wrote_balance = Attempt.Outcome.WRITTEN, read + 1
    attempt.wrote_us = db_now_us(lease.using)
    # Did it still hold the lock when it wrote? (The unfenced stale holder does not know.)
    attempt.lease_still_held = lease.remaining() > 0 and attempt.taken_over_by is None
    attempt.save(update_fields=["outcome", "wrote_balance", "lease_still_held", "wrote_us"])
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
