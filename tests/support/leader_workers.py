"""Child-process roles for tests/test_leader.py (run by tests/support/worker.py).

Each role campaigns with :func:`distlock.leader.run_as_leader` for the lock of one
``testapp.Account`` row and, while it leads, writes that row fenced by its term: the
parent kills or pauses it and sees who leads next and what the database lets the deposed
leader write.
"""

from __future__ import annotations

import time
from typing import Any

from tests.support.worker import emit, lease_data


def campaign(pk: Any, ttl: float, careful: bool) -> None:
    """Lead the account's election for as long as this process lives.

    ``careful``: the loop writes between ``term.sleep(0.02)`` calls and so stops at once
    when its term is over; otherwise it writes every 20 ms without asking (a leader that
    keeps running after a pause), and only the fenced write can stop it.
    """
    from distlock.leader import Term, run_as_leader
    from tests.testapp.models import Account

    account = Account._base_manager.get(pk=pk)

    def elected(term: Term) -> None:
        emit("elected", term=term.token, **lease_data(term.lease))

    def lost(term: Term) -> None:
        emit("lost", term=term.token)

    def loop(term: Term) -> None:
        first = True
        while term.sleep(0.02) if careful else True:
            account.note = f"term {term.token}"
            account.save(fence=term.lease)
            if first:
                emit("wrote", term=term.token)
                first = False
            if not careful:
                time.sleep(0.02)

    run_as_leader(account.get_fence_name(), loop, ttl=ttl, on_elected=elected,
                  on_lost=lost)


def idle(term: Any) -> None:
    """A leader's loop for the distlock_leader command's test: sleeps until its term is
    over or the command is told to stop."""
    while term.sleep(0.1):
        pass


def done_at_once(term: Any) -> None:
    """A loop that returns while it leads: the command steps down and exits 0."""
