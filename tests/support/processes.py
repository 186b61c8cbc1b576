"""Real OS processes for contention tests.

Each child is ``python -m tests.support.worker ROLE ARGS_JSON`` with its own interpreter, Django
and database connection, talking to the same test database as the test. It prints one JSON
object per line (its events) and reads commands one per line on stdin. Tests wait on the
events they expect, each with a deadline; nothing sleeps to make a test pass.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from django.db import connection

ROOT = Path(__file__).resolve().parents[2]  # the repository: children run there
# Debian's libfaketime (package faketime); None where it is not installed.
LIBFAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), None)


def skewed_clock_env(skew: str) -> dict[str, str]:
    """Environment variables that shift a child's wall clock by ``skew`` (``"+30s"``).

    libfaketime is preloaded directly rather than through the ``faketime`` wrapper: the
    wrapper keeps a named semaphore per pid in /dev/shm that a SIGKILLed wrapper leaves
    behind, and a later wrapper that gets the same pid then dies with "sem_open: File
    exists" (seen in CI after the stress harness killed skewed workers). Not
    FAKETIME_DONT_FAKE_MONOTONIC: with it, libfaketime 0.9.10 makes ``time.sleep()`` fail
    with EINVAL; a monotonic clock shifted by a constant changes no duration.
    """
    assert LIBFAKETIME is not None, "libfaketime is not installed (Debian package faketime)"
    return {"LD_PRELOAD": LIBFAKETIME, "FAKETIME": skew, "FAKETIME_NO_CACHE": "1"}


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that uses this test run's database."""
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DISTLOCK_TEST_CHILD_DB": str(connection.settings_dict["NAME"]),
        "PYTHONPATH": str(ROOT),
        **extra,
    }


class Child:
    """``python -m tests.support.worker ROLE ARGS``; ``prefix`` runs it through another
    program that execs it (``ip netns exec NS``: a worker on another "host"), so the
    process is still the one this object signals and kills."""

    def __init__(self, role: str, *args: Any, env: dict[str, str] | None = None,
                 prefix: Sequence[str] = ()) -> None:
        self.role = role
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tests.support.worker", role, json.dumps(args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=child_env(**(env or {})), cwd=ROOT, start_new_session=True,
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                if line.startswith("{"):
                    self.events.put(json.loads(line))
        self.events.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for line in self.proc.stderr:
                self.stderr.append(line)

    def next_event(self, timeout: float = 30.0) -> dict[str, Any]:
        """The next event, whatever its kind; fails on an error event, exit or deadline."""
        try:
            got = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.role}: no event within {timeout} s") from None
        if got is None:
            self.proc.wait(timeout=10)
            raise AssertionError(
                f"{self.role} exited ({self.proc.returncode}):\n" + "".join(self.stderr[-30:])
            )
        if got.get("event") == "error":
            raise AssertionError(f"{self.role} failed: {got}\n" + "".join(self.stderr[-30:]))
        return got

    def expect(self, event: str, timeout: float = 30.0) -> dict[str, Any]:
        """The next event of this kind; fails on a different event, exit or deadline."""
        got = self.next_event(timeout)
        if got.get("event") != event:
            raise AssertionError(f"{self.role}: expected {event!r}, got {got}")
        return got

    def send(self, command: str, **data: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"command": command, **data}) + "\n")
        self.proc.stdin.flush()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def _close(self) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()

    def _join_readers(self) -> None:
        for reader in self._readers:
            reader.join(timeout=10)

    def finish(self, timeout: float = 60.0) -> int:
        """Wait for a normal exit (closing stdin first); kill on the deadline."""
        self._close()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.role} did not exit within {timeout} s") from None
        self._join_readers()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._close()
        self._join_readers()


class Children:
    """A group of children that are always killed at the end of a test."""

    def __init__(self) -> None:
        self.all: list[Child] = []

    def start(self, role: str, *args: Any, **kwargs: Any) -> Child:
        child = Child(role, *args, **kwargs)
        self.all.append(child)
        return child

    def close(self) -> None:
        for child in self.all:
            child.kill()


class LoggedWorker:
    """A long-running worker process (a Celery or Django Tasks worker) in its own session
    (process group), its output in a log file; stopped by killing that group by its id.

    ``argv`` runs in the repository with :func:`child_env` plus ``env``.
    """

    what = "worker"

    def __init__(self, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=child_env(**env), cwd=ROOT, start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_for(self, ready: Callable[[], bool], timeout: float) -> None:
        """Wait until ``ready()``; fail (stopping the worker) if it exits or times out."""
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.what} exited ({self.proc.returncode}):\n"
                                     + self.tail())
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"{self.what} not ready within {timeout} s:\n"
                                     + self.tail())
            time.sleep(0.05)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """Kill the worker and its children (its own process group) and reap it.

        The tests wait for their tasks to finish, so nothing is in flight here and a
        warm shutdown would only cost time.
        """
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        # Children that outlived their parent are in the same group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
