"""Child processes of tests/test_periodic.py: one host's periodic job.

``python -m tests.support.worker tests.support.periodic_workers:job ARGS``; each "fire" on
stdin calls the job once, as a task delivered by a broker would, and reports whether its
body ran (and under which lock and token).
"""

from __future__ import annotations

import os
import time
from typing import Any

from tests.support.worker import command, emit


def job(name: str, every: float, at: float) -> None:
    from distlock import current_lease
    from distlock.periodic import periodic_once

    @periodic_once(name, every=every, at=at, holder=f"host pid={os.getpid()}")
    def report() -> dict[str, Any]:
        lease = current_lease()
        assert lease is not None
        return {"lock": lease.name, "token": lease.token}

    emit("ready", wall=time.time())
    while True:
        order = command()["command"]
        if order == "fire":
            emit("fired", ran=report(), wall=time.time())
        elif order == "exit":
            return
