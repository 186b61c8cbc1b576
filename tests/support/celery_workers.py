"""Real ``celery worker`` processes for the Celery tests, and the events they record.

A worker is ``python -m celery -A tests.support.celery_app worker`` in its own session (process
group), pointed at the pytest test database through DISTLOCK_TEST_CHILD_DB, as
tests/support/processes.py does for plain children. Everything waits with a deadline; teardown
kills the whole process group by its id, so a wedged worker cannot outlive the test.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.celery_app import DIR_ENV, QUEUE_ENV, VISIBILITY_ENV
from tests.support.processes import ROOT, child_env

Event = dict[str, Any]


class Worker:
    """One ``celery worker`` process (prefork, ``concurrency`` children)."""

    def __init__(self, base: Path, queue: str, *, concurrency: int = 2,
                 visibility: float | None = None, app: str = "tests.support.celery_app",
                 name: str = "distlock-test") -> None:
        self.hostname = f"{name}-{uuid.uuid4().hex[:8]}"
        self.base = base
        self.log = base / f"{self.hostname}.log"
        env = child_env(TMPDIR=str(base / "tmp"), **{DIR_ENV: str(base), QUEUE_ENV: queue})
        if visibility:
            env[VISIBILITY_ENV] = str(visibility)
        (base / "tmp").mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", app, "worker",
                 "-P", "prefork", "-c", str(concurrency), "-Q", queue, "-n", f"{self.hostname}@%h",
                 "--without-gossip", "--without-mingle", "--without-heartbeat",
                 "-l", "info"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=ROOT, start_new_session=True,
            )

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(self.base.glob(f"ready-{self.hostname}@*")):
            if self.proc.poll() is not None:
                raise AssertionError(f"celery worker exited ({self.proc.returncode}):\n"
                                     + self.tail())
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"celery worker not ready within {timeout} s:\n"
                                     + self.tail())
            time.sleep(0.05)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """Kill the worker and its pool children (its own process group) and reap it.

        The tests wait for their tasks to finish, so nothing is in flight here and a
        warm shutdown (5-8 s per worker) would only cost time.
        """
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        # Pool children that outlived their parent are in the same group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


class Events:
    """The events.jsonl the tasks append to, read with deadlines."""

    def __init__(self, base: Path) -> None:
        self.path = base / "events.jsonl"

    def all(self, **match: Any) -> list[Event]:
        if not self.path.exists():
            return []
        events = [json.loads(line) for line in self.path.read_text().splitlines() if line]
        return [e for e in events if all(e.get(k) == v for k, v in match.items())]

    def wait(self, count: int = 1, timeout: float = 30.0,
             where: Callable[[Event], bool] | None = None, **match: Any) -> list[Event]:
        """At least ``count`` events matching ``match`` (and ``where``), within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.all(**match) if where is None or where(e)]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"wanted {count} event(s) {match} within {timeout} s, got {len(found)}; "
                    f"all events: {self.all()}"
                )
            time.sleep(0.05)
