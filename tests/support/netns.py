"""Hosts on this machine: Linux network namespaces joined to the root namespace by veth pairs.

Each :class:`Host` is a namespace ``dlp-NAME`` with one veth pair: ``dlp-NAME0`` in the
root namespace (address 10.231.N.1, where the private database server listens) and
``dlp-NAME1`` inside (10.231.N.2, the host's only way out). A process started with
:meth:`Host.prefix` (``ip netns exec``) reaches the database only over that link, so
:meth:`Host.cut` (``ip link set dlp-NAME0 down``) is a network partition between that
host and the database: every packet either way is dropped, silently, with no reset —
the host's TCP connections stay open and retransmit into the void, as across a broken
switch or a partitioned availability zone. The other hosts, and the test itself
(over 127.0.0.1), are not affected.

The names are fixed (one run per machine at a time): :func:`remove_leftovers` removes
what a killed run left (its processes in those namespaces by PID, the namespaces and
the links by name), so a rerun starts clean. Needs root and iproute2's ``ip``;
:func:`check` says what is missing (:class:`~tests.support.pg_clusters.Unavailable`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess

from tests.support.helpers import wait_until
from tests.support.pg_clusters import Unavailable

PREFIX = "dlp-"
NETWORK = "10.231.0.0/16"


def ip_program() -> str:
    found = shutil.which("ip") or ("/usr/sbin/ip" if os.path.exists("/usr/sbin/ip") else None)
    if found is None:
        raise Unavailable("iproute2's ip is not installed (Debian package iproute2)")
    return found


def ip(*args: str, check: bool = True) -> str:
    done = subprocess.run([ip_program(), *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr}")
    return done.stdout


def check() -> None:
    """Raise Unavailable unless this process can make namespaces and veth pairs."""
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root (ip netns add)")
    probe = f"{PREFIX}probe"
    try:
        ip("netns", "add", probe)
        ip("link", "add", f"{probe}0", "type", "veth", "peer", "name", f"{probe}1",
           "netns", probe)
    except RuntimeError as exc:
        raise Unavailable(f"cannot create a network namespace with a veth pair: {exc}") from None
    finally:
        ip("link", "del", f"{probe}0", check=False)
        ip("netns", "del", probe, check=False)


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def remove_leftovers() -> None:
    """Kill the processes in our namespaces (by PID), delete our links and namespaces."""
    ours = [name for name in namespaces() if name.startswith(PREFIX)]
    for name in ours:
        for pid in ip("netns", "pids", name, check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    for line in ip("-o", "link", "show").splitlines():
        link = line.split(":")[1].strip().split("@")[0]
        if link.startswith(PREFIX):
            ip("link", "del", link, check=False)
    for name in ours:
        ip("netns", "del", name, check=False)


class Host:
    """One namespace and its veth pair; ``number`` picks the subnet 10.231.<number>.0/24.

    ``joins``: a second link into that host's namespace instead of a namespace of its own
    (a machine with two networks, each cut on its own: tests/support/patroni.py)."""

    def __init__(self, name: str, number: int, joins: Host | None = None) -> None:
        self.name = name
        self.joins = joins
        self.namespace = joins.namespace if joins is not None else f"{PREFIX}{name}"
        self.outside = f"{PREFIX}{name}0"
        self.inside = f"{PREFIX}{name}1"
        self.gateway = f"10.231.{number}.1"  # the root namespace's end: the database
        self.address = f"10.231.{number}.2"

    def create(self) -> None:
        if self.joins is None:
            ip("netns", "add", self.namespace)
        ip("link", "add", self.outside, "type", "veth", "peer", "name", self.inside,
           "netns", self.namespace)
        ip("addr", "add", f"{self.gateway}/24", "dev", self.outside)
        ip("link", "set", self.outside, "up")
        inside = ("-n", self.namespace)
        ip(*inside, "addr", "add", f"{self.address}/24", "dev", self.inside)
        ip(*inside, "link", "set", self.inside, "up")
        if self.joins is None:
            ip(*inside, "link", "set", "lo", "up")
        self.wait_linked(True)

    def prefix(self) -> list[str]:
        """The command prefix that runs a program on this host."""
        return [ip_program(), "netns", "exec", self.namespace]

    def linked(self) -> bool:
        """Whether the host's own end has a carrier (the root end is up)."""
        state = ip("-n", self.namespace, "-o", "link", "show", "dev", self.inside)
        return "LOWER_UP" in state and "NO-CARRIER" not in state

    def wait_linked(self, up: bool) -> None:
        wait_until(lambda: self.linked() == up, 10,
                   f"{self.namespace}'s link to be {'up' if up else 'down'}", every=0.02)

    def cut(self) -> None:
        """The partition: the root end of the link goes down, nothing passes either way."""
        ip("link", "set", self.outside, "down")
        self.wait_linked(False)

    def restore(self) -> None:
        ip("link", "set", self.outside, "up")
        self.wait_linked(True)

    def remove(self) -> None:
        ip("link", "del", self.outside, check=False)
        if self.joins is not None:
            return
        for pid in ip("netns", "pids", self.namespace, check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        ip("netns", "del", self.namespace, check=False)
