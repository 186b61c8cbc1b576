"""Hosts on this machine: Linux network namespaces joined to the root namespace by veth pairs.

Each :class:`Host` is a namespace with one veth pair: the outside end in the root
namespace (address 10.231.N.1, where the servers it may reach listen) and the inside end
in the namespace (10.231.N.2, the host's only way out). A process started with
:meth:`Host.prefix` (``ip netns exec``) reaches those servers only over that link, so
:meth:`Host.cut` (the outside end set down) is a network partition between that host and
everything else: every packet either way is dropped, silently, with no reset — the
host's TCP connections stay open and retransmit into the void, as across a broken switch
or a partitioned availability zone. Other hosts, and processes in the root namespace
(over 127.0.0.1), are not affected.

Used by the lab's partition scenario (lab/scenarios.py), distlock's partition test
(tests/test_partition.py) and the Patroni harness's isolated member
(tests/support/patroni.py), possibly at the same time on one machine. So every name is
**per run**: a run (one process) takes a tag of four hex digits, unique among the runs
recorded on the machine, and records its owner — its PID and that process's start time —
in ``/run/distlock-netns/TAG``, before it creates anything. Its namespaces are
``dlkTAG-NAME`` and its links ``dlkTAGNAME0`` (outside) and ``dlkTAGNAME1`` (inside).
Each host's subnet N is the lowest from 32 up that no address of the root namespace uses,
taken under a file lock, so two runs never share one. :func:`remove_leftovers` removes
only what is provably a dead run's: the names of a tag whose recorded owner process is
gone (no such PID, or a PID since reused by a process started at another time). A
namespace without a record is never touched.

The prefix is ``dlk``, not the earlier harness's ``dlp-``: a checkout with the earlier
tests/support/netns.py removes every ``dlp-`` name it finds, and subnets 1, 2, 21 and 22,
which it used, are below 32. Needs root and iproute2's ``ip``; :func:`check` says what is
missing (:class:`~lab.servers.Unavailable`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from lab.servers import Unavailable, wait_until

PREFIX = "dlk"
NETWORK = "10.231.0.0/16"
RECORDS = Path("/run/distlock-netns")
FIRST_SUBNET = 32  # 1, 2, 21 and 22: the earlier harness's fixed subnets
NAME_LENGTH = 7  # link names: "dlk" + tag (4) + name + end (1) ≤ 15 (the kernel's IFNAMSIZ)

_tag: str | None = None


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


@contextlib.contextmanager
def machine_lock() -> Iterator[None]:
    """The machine's lock on tags and subnets: held while one is chosen and taken."""
    RECORDS.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(RECORDS / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def started(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks after boot, /proc/PID/stat), None if it
    does not exist: with the PID, it names one process, never a later one of that PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner_alive(record: Path) -> bool:
    """Whether the process recorded in ``record`` still runs; an unreadable record counts
    as alive (nothing is removed on a guess)."""
    try:
        pid, start = record.read_text().split()
        return started(int(pid)) == start
    except (OSError, ValueError):
        return True


def run_tag() -> str:
    """This process's tag, taken and recorded on first use (see the module's docstring)."""
    global _tag
    if _tag is None:
        pid = os.getpid()
        try:
            with machine_lock():
                tag = secrets.token_hex(2)
                while (RECORDS / tag).exists():
                    tag = secrets.token_hex(2)
                (RECORDS / tag).write_text(f"{pid} {started(pid)}\n")
        except OSError as exc:
            raise Unavailable(f"cannot keep the run's record in {RECORDS}: {exc}") from None
        _tag = tag
        atexit.register(_remove_own, tag, pid)
    return _tag


def _remove_own(tag: str, pid: int) -> None:
    """At this process's exit: what is left of its run. Not in a forked child, which
    inherits the handler but owns nothing."""
    if os.getpid() == pid:
        _remove_tag(tag)


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def links() -> list[str]:
    """The names of the root namespace's network interfaces."""
    return [line.split(":")[1].strip().split("@")[0]
            for line in ip("-o", "link", "show").splitlines()]


def _kill_inside(namespace: str) -> None:
    for pid in ip("netns", "pids", namespace, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _remove_tag(tag: str) -> None:
    """Every process, namespace and link of run ``tag``, then its record."""
    ours = [name for name in namespaces() if name.startswith(f"{PREFIX}{tag}-")]
    for name in ours:
        _kill_inside(name)
    for link in links():
        if link.startswith(f"{PREFIX}{tag}"):
            ip("link", "del", link, check=False)
    for name in ours:
        ip("netns", "del", name, check=False)
    with contextlib.suppress(FileNotFoundError):
        (RECORDS / tag).unlink()


def remove_leftovers() -> list[str]:
    """Remove what runs whose owner process is gone left behind (a killed test run, a
    Ctrl-C'd lab); return their tags. A live run's names, this one's included, stay."""
    if not RECORDS.is_dir():
        return []
    dead = []
    with machine_lock():
        for record in RECORDS.iterdir():
            if re.fullmatch(r"[0-9a-f]{4}", record.name) and not owner_alive(record):
                _remove_tag(record.name)
                dead.append(record.name)
    return dead


def check() -> None:
    """Raise Unavailable unless this process can make namespaces and veth pairs."""
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root (ip netns add)")
    ip_program()
    probe = Host("probe")
    try:
        ip("netns", "add", probe.namespace)
        ip("link", "add", probe.outside, "type", "veth", "peer", "name", probe.inside,
           "netns", probe.namespace)
    except RuntimeError as exc:
        raise Unavailable(f"cannot create a network namespace with a veth pair: {exc}") from None
    finally:
        ip("link", "del", probe.outside, check=False)
        ip("netns", "del", probe.namespace, check=False)


def free_subnet() -> int:
    """The lowest N ≥ FIRST_SUBNET with no root-namespace address in 10.231.N.0/24 (the
    caller holds :func:`machine_lock` until its address is added)."""
    used = {int(found) for found in
            re.findall(r"inet 10\.231\.(\d+)\.", ip("-o", "-4", "addr", "show"))}
    return next(n for n in range(FIRST_SUBNET, 255) if n not in used)


class Host:
    """One namespace and its veth pair, named for this run; its subnet is taken at
    :meth:`create`.

    ``joins``: a second link into that host's namespace instead of a namespace of its own
    (a machine with two networks, each cut on its own: tests/support/patroni.py)."""

    def __init__(self, name: str, joins: Host | None = None) -> None:
        if not re.fullmatch(rf"[a-z0-9]{{1,{NAME_LENGTH}}}", name):
            raise ValueError(f"host name {name!r}: 1 to {NAME_LENGTH} of a-z and 0-9")
        tag = run_tag()
        self.name = name
        self.joins = joins
        self.namespace: str = joins.namespace if joins is not None else f"{PREFIX}{tag}-{name}"
        self.outside: str = f"{PREFIX}{tag}{name}0"
        self.inside = f"{PREFIX}{tag}{name}1"
        self.number = 0  # the subnet, once created

    @property
    def gateway(self) -> str:
        """The root namespace's end: where the servers this host reaches listen."""
        return f"10.231.{self._subnet()}.1"

    @property
    def address(self) -> str:
        """The host's own address."""
        return f"10.231.{self._subnet()}.2"

    def _subnet(self) -> int:
        if not self.number:
            raise RuntimeError(f"host {self.name} has no subnet before create()")
        return self.number

    def create(self) -> None:
        if self.joins is None:
            ip("netns", "add", self.namespace)
        ip("link", "add", self.outside, "type", "veth", "peer", "name", self.inside,
           "netns", self.namespace)
        with machine_lock():
            self.number = free_subnet()
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
        _kill_inside(self.namespace)
        ip("netns", "del", self.namespace, check=False)
