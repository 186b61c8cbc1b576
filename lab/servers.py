"""Throw-away servers for the comparison lab and the HA tests: a three-member etcd cluster.

Debian's ``etcd-server`` (3.4) on free loopback ports, data in a temporary folder, each
member stopped by its PID (SIGTERM, then SIGKILL) and the folder removed by ``stop()``,
also after a failure. The Patroni harness (tests/support/patroni.py) and the lab's etcd
contender both start one here, so there is one way to run etcd in the project.
"""

from __future__ import annotations

import contextlib
import json
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
from typing import Any


class Unavailable(RuntimeError):
    """This machine cannot run the server; the message says why (what to install)."""


def free_port() -> int:
    """A port of 127.0.0.1 free now (the server binds it right after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until(condition: object, timeout: float, what: str, every: float = 0.05) -> None:
    """Poll ``condition()`` every ``every`` s until it is true, or raise TimeoutError
    naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():  # type: ignore[operator]
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout:g} s")
        time.sleep(every)


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
    #: More addresses the members take clients on, beside 127.0.0.1 (the root end of a
    #: network namespace's link: tests/support/patroni.py's isolated member).
    also_listen: list[str] = field(default_factory=list)
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
            "--listen-client-urls", ",".join(
                [member.client_url,
                 *(f"http://{address}:{member.client_port}" for address in self.also_listen)]
            ),
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

    def maintenance(self, index: int, call: str, body: dict[str, str]) -> dict[str, Any]:
        """POST ``/v3/maintenance/CALL`` to member ``index`` (etcd's JSON gateway)."""
        request = urllib.request.Request(
            f"{self.members[index].client_url}/v3/maintenance/{call}", json.dumps(body).encode(),
            {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            found: dict[str, Any] = json.loads(answer.read())
            return found

    def member_id(self, index: int) -> str:
        return str(self.maintenance(index, "status", {})["header"]["member_id"])

    def leader(self) -> int:
        """The index of the cluster's leader as the first running member sees it; -1 while
        it knows none (an election)."""
        asked = next(i for i, m in enumerate(self.members) if m.process is not None)
        try:
            leader = self.maintenance(asked, "status", {}).get("leader")  # absent: none
            return next((i for i in range(self.size) if self.members[i].process is not None
                         and self.member_id(i) == leader), -1)
        except OSError:  # a member busy with the election does not answer in time
            return -1

    def lead(self, index: int) -> None:
        """Member ``index`` made the leader (etcd's leadership transfer), once it is."""
        wait_until(lambda: self.leader() >= 0, 30, "an etcd leader")
        current = self.leader()
        if current != index:
            self.maintenance(current, "transfer-leadership", {"targetID": self.member_id(index)})
        wait_until(lambda: self.leader() == index, 30, f"etcd member m{index} to lead")

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


FAKETIME_LIBRARIES = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
)


def faketime_library() -> str:
    """Debian's libfaketime (package faketime), or Unavailable."""
    for path in FAKETIME_LIBRARIES:
        if os.path.exists(path):
            return path
    raise Unavailable("libfaketime not found (Debian package faketime)")


@dataclass
class RedisServer:
    """One ``redis-server`` on a free loopback port, without persistence.

    ``save ""`` and ``appendonly no``: a restart loses every key, as a Redis restarted
    without fsync does (the lab's restart fault). With ``faketime`` the server runs under
    libfaketime with a clock file of its own, read at every call, so :meth:`jump` moves
    this server's wall clock alone (the lab's clock fault); the monotonic clock stays real.
    ``binary`` must then be a Redis built without jemalloc (lab/redis_build.py).
    """

    dir: Path
    name: str = "redis"
    binary: str = "redis-server"
    faketime: bool = False
    #: More addresses it listens on beside 127.0.0.1 (the root end of a network
    #: namespace's link: the lab's partition scenario).
    also_bind: list[str] = field(default_factory=list)
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def clock_file(self) -> Path:
        return self.dir / f"{self.name}.faketime"

    @property
    def log(self) -> Path:
        return self.dir / f"{self.name}.log"

    def start(self) -> None:
        """Start (or start again on the same port, empty); returns once it answers PING."""
        if not self.port:
            self.port = free_port()
        env = dict(os.environ)
        if self.faketime:
            if not self.clock_file.exists():
                self.clock_file.write_text("+0s\n")
            env.update(LD_PRELOAD=faketime_library(),
                       FAKETIME_TIMESTAMP_FILE=str(self.clock_file),
                       FAKETIME_NO_CACHE="1", DONT_FAKE_MONOTONIC="1")
        # Protected mode takes clients on loopback only: off where a namespace's link is
        # listened on too (a private 10.231.N.1 address, no way in from outside).
        command = [self.binary, "--port", str(self.port),
                   "--bind", " ".join(["127.0.0.1", *self.also_bind]),
                   "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                   "--protected-mode", "no" if self.also_bind else "yes",
                   "--daemonize", "no", "--loglevel", "warning"]
        log = self.log.open("ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env,
                                        start_new_session=True)
        log.close()
        process = self.process

        def answers() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited {process.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            return self.ping()

        wait_until(answers, 30, f"redis-server {self.name} on port {self.port} answering")

    def ping(self) -> bool:
        """A raw PING over a socket (no client library needed here)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL by PID (a crash: nothing written to disk, and nothing to write)."""
        process = self.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait(timeout=30)
        self.process = None

    def restart(self) -> None:
        """Killed and started again on its port: every key is gone."""
        self.kill()
        self.start()

    def jump(self, seconds: float) -> None:
        """Set this server's wall clock ``seconds`` ahead of the real one (0: back)."""
        if not self.faketime:
            raise RuntimeError(f"redis-server {self.name} was not started under libfaketime")
        self.clock_file.write_text(f"{seconds:+g}s\n")


@dataclass
class RedisNodes:
    """``size`` independent redis-servers (Redlock's masters; one for plain Redis).

    A context manager; ``stop()`` kills each by its PID and removes the folder.
    """

    size: int = 1
    binary: str = "redis-server"
    faketime: bool = False
    also_bind: list[str] = field(default_factory=list)
    nodes: list[RedisServer] = field(default_factory=list)
    dir: Path | None = None

    def __enter__(self) -> RedisNodes:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def start(self) -> None:
        if shutil.which(self.binary) is None and not os.path.exists(self.binary):
            raise Unavailable(f"{self.binary} not found (Debian package redis-server)")
        self.dir = Path(tempfile.mkdtemp(prefix="distlock-redis-"))
        self.nodes = [RedisServer(self.dir, f"r{i}", self.binary, self.faketime,
                                  list(self.also_bind))
                      for i in range(self.size)]
        try:
            for node in self.nodes:
                node.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
