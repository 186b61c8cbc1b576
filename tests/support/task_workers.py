"""Real ``db_worker`` processes (django-tasks-db) for the Django Tasks tests.

A worker is ``python -m django db_worker`` with the test settings, in its own session,
pointed at the pytest test database through DISTLOCK_TEST_CHILD_DB as every child is
(tests/support/processes.py), recording events in ``base`` (tests/support/events.py). It
runs one task at a time, so contention needs several. Teardown kills it by its process
group id.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from tests.support.processes import LoggedWorker
from tests.support.tasks import DIR_ENV


class DbWorker(LoggedWorker):
    """One ``db_worker`` process on ``queue``, polling every 50 ms."""

    what = "db_worker"

    def __init__(self, base: Path, queue: str = "default", *, name: str = "dl") -> None:
        self.worker_id = f"{name}-{uuid.uuid4().hex[:8]}"
        super().__init__(
            [sys.executable, "-m", "django", "db_worker", "--queue-name", queue,
             "--interval", "0.05", "--no-startup-delay", "--no-reload",
             "--worker-id", self.worker_id, "--verbosity", "1"],
            base / f"{self.worker_id}.log", {DIR_ENV: str(base)},
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        # db_worker logs this line (at verbosity 1) just before it starts polling.
        self.wait_for(lambda: "Starting worker" in self.tail(), timeout)


def start_workers(base: Path, count: int, queue: str = "default") -> list[DbWorker]:
    """``count`` workers started together, each ready (or all stopped and the test failed)."""
    workers = [DbWorker(base, queue) for _ in range(count)]
    try:
        for worker in workers:
            worker.wait_ready()
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers
