"""The demo's worker processes: ``celery worker``, or django-tasks-db's ``db_worker``.

N of them in one new process group (outside the terminal's, so Ctrl-C reaches only the
command, which then stops the group), stopped by that group id.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import CommandError

#: The task runners the demo can use, as the report names their workers.
RUNNERS = {"celery": "Celery workers", "django-tasks": "Django Tasks db_worker processes"}


class Workers:
    """N worker processes of ``runner`` ("celery" or "django-tasks") on ``queue``, in one
    new process group, stopped by that group id."""

    def __init__(self, count: int, queue: str, folder: Path, ttl: float,
                 runner: str = "celery") -> None:
        self.folder = folder
        self.count = count
        self.runner = runner
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pgid: int | None = None
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "demo_project.settings",
            "DEMO_LOCK_TTL": str(ttl),
            "DEMO_READY_DIR": str(folder),
            "PYTHONPATH": os.pathsep.join(
                [str(settings.BASE_DIR), os.environ.get("PYTHONPATH", "")]
            ),
        }
        try:
            for number in range(1, count + 1):
                self._start(number, queue, env)
        except BaseException:
            self.stop(grace=0)
            raise

    def _start(self, number: int, queue: str, env: dict[str, str]) -> None:
        # The first worker leads a new process group (outside the terminal's, so Ctrl-C
        # reaches only this command, which then stops the group); the others join it.
        with open(self.folder / f"worker{number}.log", "wb") as log:
            proc = subprocess.Popen(
                self._command(number, queue), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=env, cwd=settings.BASE_DIR,
                process_group=self.pgid or 0,
            )
        self.procs.append(proc)
        if self.pgid is None:
            self.pgid = proc.pid

    def _command(self, number: int, queue: str) -> list[str]:
        if self.runner == "celery":
            return [
                sys.executable, "-m", "celery", "-A", "demo_project.celery", "worker",
                "-P", "prefork", "-c", "1", "-Q", queue, "-n", f"demo{number}@%h",
                "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "warning",
            ]
        # One task at a time per process, like a Celery worker with -c 1. Verbosity 1
        # logs the "Starting worker" line that wait_ready looks for.
        return [
            sys.executable, "-m", "django", "db_worker", "--queue-name", queue,
            "--interval", "0.1", "--no-startup-delay", "--no-reload",
            "--worker-id", f"demo{number}-{queue.removeprefix('demo-')}", "--verbosity", "1",
        ]

    def _ready(self) -> int:
        """How many workers are ready to take tasks."""
        if self.runner == "celery":  # demo_project/celery.py writes a file when ready
            return len(list(self.folder.glob("ready-*")))
        return sum("Starting worker" in self.tail(number, 1000)
                   for number in range(1, self.count + 1))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._ready() < self.count:
            for number, proc in enumerate(self.procs, 1):
                if proc.poll() is not None:
                    raise CommandError(
                        f"worker {number} exited with {proc.returncode}:\n"
                        + self.tail(number)
                    )
            if time.monotonic() > deadline:
                raise CommandError(f"the workers were not ready within {timeout:.0f} s")
            time.sleep(0.1)

    def tail(self, number: int, lines: int = 20) -> str:
        path = self.folder / f"worker{number}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the group (warm shutdown), SIGKILL whatever is left after ``grace`` s."""
        if self.pgid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        # The workers' pool children are the group too; they are gone only once reaped.
        gone_by = time.monotonic() + 5
        while time.monotonic() < gone_by:
            try:
                os.killpg(self.pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        self.pgid = None
