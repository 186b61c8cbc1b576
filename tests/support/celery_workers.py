"""Real ``celery worker`` processes for the Celery tests (their events: tests/support/events.py).

A worker is ``python -m celery -A tests.support.celery_app worker`` in its own session (process
group), pointed at the pytest test database through DISTLOCK_TEST_CHILD_DB, as
tests/support/processes.py does for plain children. Everything waits with a deadline; teardown
kills the whole process group by its id, so a wedged worker cannot outlive the test.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

from tests.support.celery_app import DIR_ENV, QUEUE_ENV, VISIBILITY_ENV
from tests.support.processes import LoggedWorker


class Worker(LoggedWorker):
    """One ``celery worker`` process (prefork, ``concurrency`` children)."""

    what = "celery worker"

    def __init__(self, base: Path, queue: str, *, concurrency: int = 2,
                 visibility: float | None = None, app: str = "tests.support.celery_app",
                 name: str = "distlock-test") -> None:
        self.hostname = f"{name}-{uuid.uuid4().hex[:8]}"
        self.base = base
        env = {"TMPDIR": str(base / "tmp"), DIR_ENV: str(base), QUEUE_ENV: queue}
        if visibility:
            env[VISIBILITY_ENV] = str(visibility)
        (base / "tmp").mkdir(parents=True, exist_ok=True)
        super().__init__(
            [sys.executable, "-m", "celery", "-A", app, "worker",
             "-P", "prefork", "-c", str(concurrency), "-Q", queue, "-n", f"{self.hostname}@%h",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
            base / f"{self.hostname}.log", env,
        )

    def wait_ready(self, timeout: float = 60.0) -> None:
        self.wait_for(lambda: any(self.base.glob(f"ready-{self.hostname}@*")), timeout)
