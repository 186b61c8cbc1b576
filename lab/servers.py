"""Throw-away servers for the comparison lab and the HA tests: a three-member etcd cluster.

Debian's ``etcd-server`` (3.4) on free loopback ports, data in a temporary folder, each
member stopped by its PID (SIGTERM, then SIGKILL) and the folder removed by ``stop()``,
also after a failure. The Patroni harness (tests/support/patroni.py) and the lab's etcd
contender both start one here, so there is one way to run etcd in the project.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType


class Unavailable(RuntimeError):
    """This machine cannot run the server; the message says why (what to install)."""


def free_port() -> int:
    """A port of 127.0.0.1 free now (the server binds it right after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until(condition: object, timeout: float, what: str) -> None:
    """Poll ``condition()`` until it is true, or raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():  # type: ignore[operator]
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:g} s")
        time.sleep(0.05)


@dataclass
class EtcdMember:
    """One member: its name, ports and process (None while stopped)."""

    name: str
    client_port: int
    peer_port: int
    data: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def healthy(self) -> bool:
        """etcd's own /health answer: this member is in a cluster with a leader."""
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=1) as answer:
                return b'"true"' in answer.read()
        except OSError:
            return False


@dataclass
class EtcdCluster:
    """``size`` etcd members on loopback; a context manager (``with EtcdCluster() as c``).

    ``endpoints`` is what clients take (``host:port`` list); ``kill(i)``/``start(i)`` are the
    faults (a member SIGKILLed, then back with its data).
    """

    size: int = 3
    election_ms: int = 1000
    heartbeat_ms: int = 100
    members: list[EtcdMember] = field(default_factory=list)
    dir: Path | None = None

    def __enter__(self) -> EtcdCluster:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{m.client_port}" for m in self.members]

    @property
    def client_urls(self) -> list[str]:
        return [m.client_url for m in self.members]

    def start(self) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise Unavailable("etcd not found (Debian package etcd-server)")
        self.dir = Path(tempfile.mkdtemp(prefix="distlock-etcd-"))
        self.members = [
            EtcdMember(f"m{i}", free_port(), free_port(), self.dir / f"m{i}",
                       self.dir / f"m{i}.log")
            for i in range(self.size)
        ]
        try:
            for index in range(self.size):
                self.start_member(index, new=True)
            for member in self.members:
                wait_until(member.healthy, 60, f"etcd member {member.name} healthy")
        except BaseException:
            self.stop()
            raise

    def start_member(self, index: int, *, new: bool = False) -> None:
        """Start member ``index`` (again, with its data, unless ``new``)."""
        member = self.members[index]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        command = [
            shutil.which("etcd") or "etcd",
            "--name", member.name,
            "--data-dir", str(member.data),
            "--listen-client-urls", member.client_url,
            "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", cluster,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", f"distlock-{os.getpid()}-{id(self)}",
            "--election-timeout", str(self.election_ms),
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--enable-v2=true",
        ]
        log = member.log.open("ab")
        # Its own session: a Ctrl-C of the test run does not reach it before stop() does.
        member.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (a crash: no goodbye to its peers)."""
        member = self.members[index]
        if member.process is not None:
            with contextlib.suppress(ProcessLookupError):
                member.process.send_signal(signal.SIGKILL)
            member.process.wait(timeout=30)
            member.process = None

    def start_again(self, index: int) -> None:
        """Member ``index`` back with its data; returns once it is healthy."""
        self.start_member(index)
        wait_until(self.members[index].healthy, 60,
                   f"etcd member {self.members[index].name} healthy again")

    def stop(self) -> None:
        """Every member stopped by its PID (SIGTERM, then SIGKILL), the folder removed."""
        for member in self.members:
            process = member.process
            if process is None:
                continue
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                process.wait(timeout=10)
            member.process = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
