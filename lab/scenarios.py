"""The lab's scenarios: two clients A and B, one fault, real processes, a trial count.

Every trial runs the same steps, with the fault switched on or off (the control):

1. the rows are reset; A acquires (ttl), reads its row;
2. B asks for the lock (blocking: it keeps trying in its own process);
3. fault on: the fault strikes (A SIGSTOPped, Redis restarted, a Redis clock jumped, A's
   host cut off); if B is granted it reads and writes its row; the fault heals (A
   SIGCONTed, A's link up again); A writes
   the value it read plus one; A releases, then B;
   fault off: A writes and releases; B is granted, reads, writes, releases.

The measures are read from one history of both clients' operations on the machine's
monotonic clock (lab/worker.py) and from the rows at the end: overlapping critical
sections (grant to release, or to the last write after it), stale writes (a write by a
client after another client was granted the lock since its own grant) accepted or refused,
increments accepted, the counter total and the lost updates (accepted minus total), and
the tokens issued again (a grant's token not above an earlier grant's in the trial).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lab.django_setup import database
from lab.netns import Host
from lab.pg_servers import DATABASE, Replicated
from lab.servers import EtcdCluster, RedisNodes

ROOT = Path(__file__).resolve().parent.parent
REACH = 0.5  # seconds a connection from A's host may take in the partition's reach probe
JUMP = 60.0  # seconds a Redis node's clock steps forward in the clock scenario
LONG_TTL = 30.0  # A's ttl where the fault is not a pause: A is well inside it when it writes


class HarnessError(RuntimeError):
    """The lab itself failed (a worker error, no grant where one was due): not a result."""


class Client:
    """A worker process (lab/worker.py) and the answers it gives, read by a thread."""

    def __init__(self, role: str, contender: str, config: dict[str, Any],
                 prefix: list[str] | None = None) -> None:
        """``prefix``: the command that runs it on another host (``ip netns exec NS``,
        which execs the worker: its PID is the worker's, for the signals)."""
        self.role = role
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.process = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "lab.worker", contender,
             json.dumps(config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT,
            start_new_session=True,
        )
        self.answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.reply(60)  # ready

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.answers.put(json.loads(line))
        self.answers.put(None)

    def send(self, op: str, **data: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **data}) + "\n")
        self.process.stdin.flush()

    def reply(self, timeout: float) -> dict[str, Any]:
        try:
            got = self.answers.get(timeout=timeout)
        except queue.Empty:
            raise HarnessError(f"client {self.role}: no answer within {timeout:g} s") from None
        if got is None:
            raise HarnessError(f"client {self.role} exited ({self.process.poll()})")
        if "error" in got:
            raise HarnessError(f"client {self.role}, {got['op']}: {got['error']}\n"
                               f"{got['trace']}")
        return got

    def call(self, op: str, wait: float = 60, **data: Any) -> dict[str, Any]:
        """``op`` sent and its answer, waited for ``wait`` seconds at most."""
        self.send(op, **data)
        return self.reply(wait)

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    def close(self) -> None:
        """Asked to quit; killed by its PID if it does not."""
        self.signal(signal.SIGCONT)  # never leave a stopped process behind
        try:
            self.send("quit")
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait(timeout=10)


@dataclass
class Servers:
    """What a contender needs running: Redis nodes and a PostgreSQL pair (per cell), etcd
    (per run); in the partition scenario the holder's host (per run), where A runs."""

    redis: RedisNodes | None = None
    etcd: EtcdCluster | None = None
    pg: Replicated | None = None
    scenario: str = ""
    follow: bool = True  # DISTLOCK_FOLLOW_TIMELINE of the distlock clients
    holder: Host | None = None

    @property
    def master_file(self) -> Path | None:
        """Where the failover scenario names the current Redis master (its port)."""
        return self.redis.dir / "master" if self.redis and self.redis.dir else None

    def config(self, postgres: str, role: str = "") -> dict[str, Any]:
        """A client's servers. Client A on the holder's host reaches each over its link:
        at the link's root end (every server of the partition scenario listens there too)
        instead of 127.0.0.1."""
        config: dict[str, Any] = {
            "postgres": self.pg.url() if self.pg else postgres,
            "follow": self.follow,
            "redis_master_file": str(self.master_file or ""),
            "redis_ports": self.redis.ports if self.redis else [],
            "etcd_endpoints": self.etcd.endpoints if self.etcd else [],
        }
        if role == "A" and self.holder is not None:
            gateway = self.holder.gateway
            config["postgres"] = config["postgres"].replace("@127.0.0.1:", f"@{gateway}:")
            config["redis_host"] = gateway
            config["etcd_endpoints"] = [endpoint.replace("127.0.0.1:", f"{gateway}:")
                                        for endpoint in config["etcd_endpoints"]]
        return config

    def prefix(self, role: str) -> list[str]:
        """The command prefix of client ``role``: A runs on the holder's host, if any."""
        return self.holder.prefix() if role == "A" and self.holder is not None else []


class Fault:
    """A scenario's fault. ``before``/``granted`` run in control trials too."""

    heals = False  # whether heal() undoes something (the timeline marks it then)
    # Whether A's lease is the short ttl, to run out during the fault (a pause, a
    # partition), rather than LONG_TTL, which A is well inside when it writes.
    expires = False
    # With the fault on, how long B asks for the lock (None: until A's pause ttl has run
    # out four times over): a fault the lock should survive needs no longer than that.
    ask: float | None = None

    def __init__(self, servers: Servers, a: Client, config_a: dict[str, Any] | None = None
                 ) -> None:
        """``config_a``: client A's servers, as A reaches them (Servers.config)."""
        self.servers, self.a, self.config_a = servers, a, config_a or {}

    def before(self) -> None:
        """Before A's acquire."""

    def granted(self) -> None:
        """Right after A's grant."""

    def strike(self) -> None:
        raise NotImplementedError

    def heal(self) -> None:
        """After B's write, before A's."""

    def clean(self) -> None:
        """After the trial, fault or not: the servers as they were."""
        if self.servers.redis:
            import redis

            for node in self.servers.redis.nodes:
                if node.faketime:
                    node.jump(0)
                if node.process is None:
                    node.start()
                redis.Redis(port=node.port, socket_timeout=5).flushall()


class Pause(Fault):
    """A is SIGSTOPped (a GC pause, a swapped-out VM) until B has written."""

    heals = True
    expires = True

    def strike(self) -> None:
        self.a.signal(signal.SIGSTOP)

    def heal(self) -> None:
        self.a.signal(signal.SIGCONT)


class Partition(Fault):
    """A's host is cut off (lab/netns.py: its link's root end down, every packet either way
    dropped, nothing reset) until B has written.

    A runs in a network namespace of its own and reaches everything — the lock service
    and the resource alike — over that one link: for distlock they are one database, and
    for the others the cut takes A's host off the network, as a partitioned machine is.
    A does nothing during the cut: like a holder whose partition nobody tells it about,
    its next operation is after the heal, the write with its old token or lease. B, on
    the root namespace's loopback, is granted once A's lease has run out.
    """

    heals = True
    expires = True

    def host(self) -> Host:
        assert self.servers.holder is not None
        return self.servers.holder

    def addresses(self) -> list[list[Any]]:
        """Every server A uses (the database, the Redis nodes, the etcd members), as
        ``[host, port]`` the way A reaches it: at the link's root end."""
        config = self.config_a
        entry = database(config["postgres"])
        found: list[list[Any]] = [[entry["HOST"], int(entry["PORT"])]]
        found += [[config["redis_host"], port] for port in config["redis_ports"]]
        found += [[host, int(port)] for host, _, port in
                  (endpoint.rpartition(":") for endpoint in config["etcd_endpoints"])]
        return found

    def reach(self) -> set[str]:
        """The servers A's host reaches now (lab/worker.py's reach, run by A)."""
        return set(self.a.call("reach", wait=30, addresses=self.addresses(),
                               timeout=REACH)["result"])

    def granted(self) -> None:
        """Fault or not, A reaches every server, over its link (its only way out)."""
        every = {f"{host}:{port}" for host, port in self.addresses()}
        if missing := every - self.reach():
            raise HarnessError(f"A's host does not reach {sorted(missing)} over its link")

    def strike(self) -> None:
        """The cut, and the proof that it holds: A's host reaches none of the servers."""
        self.host().cut()
        if reached := self.reach():
            raise HarnessError(f"A's host still reaches {sorted(reached)} with its link cut")

    def heal(self) -> None:
        self.host().restore()

    def clean(self) -> None:
        if not self.host().linked():  # a trial that failed during the cut
            self.host().restore()
        super().clean()


class Restart(Fault):
    """The Redis holding A's key restarts without persistence (``appendonly no``): for
    Redlock a majority of the masters (three of five), as no delayed restart was set up."""

    def strike(self) -> None:
        assert self.servers.redis is not None
        nodes = self.servers.redis.nodes
        for node in nodes[: len(nodes) // 2 + 1]:
            node.restart()


class Clock(Fault):
    """The wall clock of a Redis node that holds A's key jumps ``JUMP`` s forward.

    Kleppmann's Redlock case: two of the five masters are down while A is granted (so A
    holds three), then come back empty; the clock of one of A's three jumps and B can get
    three of five. With one Redis, that server's clock jumps.
    """

    def down(self) -> list[Any]:
        assert self.servers.redis is not None
        nodes = self.servers.redis.nodes
        return nodes[3:] if len(nodes) == 5 else []

    def before(self) -> None:
        for node in self.down():
            node.kill()

    def granted(self) -> None:
        for node in self.down():
            node.start()

    def strike(self) -> None:
        assert self.servers.redis is not None
        self.servers.redis.nodes[0].jump(JUMP)


class Failover(Fault):
    """The Redis master dies; its replica, which had not received A's key, is promoted.

    Replication is asynchronous: a master can acknowledge A's SET and die before sending
    it. The lab makes that worst case certain rather than lucky: the replica is in sync
    with the master, then detached (``REPLICAOF NO ONE``) just before A's grant. On the
    fault the master is killed and the clients are told the replica's port (as Sentinel
    would tell them). Without the fault the master lives, and the replica is not used.
    """

    def redis(self, index: int) -> Any:
        import redis

        assert self.servers.redis is not None
        return redis.Redis(port=self.servers.redis.nodes[index].port, socket_timeout=5)

    def before(self) -> None:
        import redis

        assert self.servers.redis is not None and self.servers.master_file is not None
        master, replica = self.servers.redis.nodes
        self.name_master(master.port)
        self.redis(0).config_set("repl-diskless-sync-delay", 0)
        self.redis(1).replicaof("127.0.0.1", master.port)

        def in_sync() -> bool:
            info = self.redis(1).info("replication")
            return bool(info.get("master_link_status") == "up"
                        and not info.get("master_sync_in_progress"))

        deadline = time.monotonic() + 30
        while not in_sync():
            if time.monotonic() > deadline:
                raise HarnessError("the Redis replica did not sync within 30 s")
            time.sleep(0.02)
        with contextlib.suppress(redis.ConnectionError):
            self.redis(1).replicaof("NO", "ONE")

    def strike(self) -> None:
        assert self.servers.redis is not None and self.servers.master_file is not None
        self.servers.redis.nodes[0].kill()
        self.name_master(self.servers.redis.nodes[1].port)

    def name_master(self, port: int) -> None:
        """The master's port for the clients, written whole (a rename), never half."""
        assert self.servers.master_file is not None
        partial = self.servers.master_file.with_suffix(".partial")
        partial.write_text(str(port))
        partial.rename(self.servers.master_file)


class PgFailover(Fault):
    """The PostgreSQL primary dies; its asynchronous standby, which had not received A's
    grant, is promoted, and the clients go on against it (``pg-failover*``).

    As in :class:`Failover`, the lost grant is made certain rather than lucky: the standby
    has replayed everything, then its WAL receiver is stopped just before A's grant
    (lab.pg_servers.Replicated.cut_replication), so the primary acknowledges A's grant and
    the standby never has it. On the fault the primary is crashed (``pg_ctl stop -m
    immediate``) and the standby promoted; the clients' libpq host list (read-write) finds
    it. The three variants (:data:`PG_VARIANTS`): the timeline follow on (distlock's
    default, no operator step); the follow off with ``manage.py distlock_failover`` run by
    the operator on the promoted server while it still refuses the application (pg_hba);
    the follow off with no step, the control that shows the hazard: A's token is issued
    again to B. Without the fault the primary lives and the standby catches up again.
    """

    heals = False

    def pair(self) -> Replicated:
        assert self.servers.pg is not None
        return self.servers.pg

    def before(self) -> None:
        pair = self.pair()
        wait_for(lambda: pair.lag() == 0, 30, "the standby to replay all the primary's WAL")
        pair.cut_replication()

    def strike(self) -> None:
        pair, step = self.pair(), PG_VARIANTS[self.servers.scenario][1]
        assert pair.standby is not None
        if step:  # the runbook: the application cannot reach the server until the step ran
            pair.standby.refuse_tcp()
        pair.primary.crash()
        pair.promote()
        if step:
            standby = pair.standby
            socket = str(standby.dir).replace("/", "%2F")
            url = f"postgresql://postgres@{socket}:{standby.port}/{DATABASE}"
            done = subprocess.run(
                [sys.executable, "-m", "lab.worker", "--failover",
                 json.dumps({"postgres": url, "follow": False})],
                cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                text=True, timeout=120)
            if done.returncode != 0:
                raise HarnessError(f"distlock_failover failed: {done.stdout}{done.stderr}")
            standby.accept_tcp()

    def clean(self) -> None:
        pair = self.pair()
        if pair.primary.data.joinpath("postmaster.pid").exists():
            pair.resume_replication()  # fault off: the primary lives, the standby streams
        else:
            pair.replace_primary()  # a new standby from the promoted one, on the old port


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """``condition()`` polled until true; HarnessError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise HarnessError(f"{what}: not within {timeout:g} s")
        time.sleep(0.02)


class EtcdMemberLoss(Fault):
    """The etcd member the clients talk to, made the cluster's leader just before A's grant
    (etcd's leadership transfer), is SIGKILLed while A holds (``etcd-member``).

    The worst single member to lose: the leader, so the other two elect another, and the
    clients' own endpoint, so they go on through the next one. A's lease (30 s) outlives
    the trial: B asks for ``ask`` seconds, past the new election (1 s election timeout,
    which the driver waits for), and must not be granted. The member comes back with its
    data after the trial.
    """

    ask = 5.0

    def cluster(self) -> EtcdCluster:
        assert self.servers.etcd is not None
        return self.servers.etcd

    def before(self) -> None:
        self.cluster().lead(0)

    def strike(self) -> None:
        """The kill, and a new leader among the other two before B's ask is judged: a B
        refused by a cluster with no leader would say nothing about the lock."""
        cluster = self.cluster()
        cluster.kill(0)
        wait_for(lambda: cluster.leader() > 0, 10, "the other etcd members to elect a leader")

    def clean(self) -> None:
        if self.cluster().members[0].process is None:
            self.cluster().start_again(0)


# The PostgreSQL failover's variants: scenario → (DISTLOCK_FOLLOW_TIMELINE, operator step).
PG_VARIANTS = {"pg-failover": (True, False), "pg-failover-step": (False, True),
               "pg-failover-nostep": (False, False)}
FAULTS: dict[str, type[Fault]] = {"pause": Pause, "untouched": Pause, "restart": Restart,
                                  "clock": Clock, "failover": Failover,
                                  "etcd-member": EtcdMemberLoss, "partition": Partition,
                                  **dict.fromkeys(PG_VARIANTS, PgFailover)}
CONTENDERS = ("redis", "redlock", "etcd", "distlock", "distlock-fenced")
SCENARIOS = ("pause", "untouched", "restart", "clock", "failover", *PG_VARIANTS,
             "etcd-member", "partition")
# What each scenario is about, and whom: a Redis restart, clock or failover is no fault of
# etcd or PostgreSQL, a PostgreSQL failover none of Redis or etcd, an etcd member lost
# none of the others; a pause or a partition of the holder is everyone's.
APPLIES = {
    "pause": ("redis", "redlock", "etcd", "distlock", "distlock-fenced"),
    "untouched": ("redis", "redlock", "etcd", "distlock", "distlock-fenced"),
    "restart": ("redis", "redlock"),
    "clock": ("redis", "redlock"),
    "failover": ("redis",),
    **dict.fromkeys(PG_VARIANTS, ("distlock", "distlock-fenced")),
    "etcd-member": ("etcd",),
    "partition": ("redis", "redlock", "etcd", "distlock", "distlock-fenced"),
}


@dataclass
class Event:
    """One operation on the shared history (seconds since the trial's start)."""

    client: str
    op: str
    t0: float
    t1: float
    result: Any = None
    key: str = ""
    stale: bool = False


@dataclass
class Trial:
    fault: bool
    events: list[Event] = field(default_factory=list)
    marks: list[tuple[str, float]] = field(default_factory=list)  # fault, heal
    overlapping: bool = False
    stale_accepted: int = 0
    stale_refused: int = 0
    increments: int = 0
    total: int = 0
    reissued: int = 0

    @property
    def lost(self) -> int:
        return self.increments - self.total


def run_trial(a: Client, b: Client, fault: Fault, *, on: bool, scenario: str, ttl: float,
              reset: Callable[[], None], total: Callable[[], int]) -> Trial:
    trial = Trial(fault=on)
    start = [0.0]
    rows = ("a", "b") if scenario == "untouched" else ("a", "a")
    ttl_a = ttl if fault.expires else LONG_TTL

    def record(client: Client, answer: dict[str, Any], **extra: Any) -> Any:
        trial.events.append(Event(client.role, answer["op"], answer["t0"] - start[0],
                                  answer["t1"] - start[0], answer["result"], **extra))
        return answer["result"]

    def mark(what: str) -> None:
        trial.marks.append((what, time.monotonic() - start[0]))

    reset()
    start[0] = time.monotonic()
    fault.before()
    if record(a, a.call("acquire", ttl=ttl_a, timeout=10)) is None:
        raise HarnessError("A was not granted a free lock")
    fault.granted()
    value_a = record(a, a.call("read", key=rows[0]), key=rows[0])
    wait_b = fault.ask if on and fault.ask is not None else ttl * 4 + 10
    b.send("acquire", ttl=ttl, timeout=wait_b)
    if on:
        mark("fault")
        fault.strike()
        granted_b = record(b, b.reply(wait_b + 30)) is not None
        if granted_b:
            value_b = record(b, b.call("read", key=rows[1]), key=rows[1])
            record(b, b.call("write", key=rows[1], value=value_b + 1), key=rows[1])
        if fault.heals:
            mark("heal")
        fault.heal()
        record(a, a.call("write", key=rows[0], value=value_a + 1), key=rows[0])
        record(a, a.call("release"))
        if granted_b:
            record(b, b.call("release"))
    else:
        record(a, a.call("write", key=rows[0], value=value_a + 1), key=rows[0])
        record(a, a.call("release"))
        if record(b, b.reply(wait_b + 30)) is None:
            raise HarnessError("B was not granted the lock A released")
        value_b = record(b, b.call("read", key=rows[1]), key=rows[1])
        record(b, b.call("write", key=rows[1], value=value_b + 1), key=rows[1])
        record(b, b.call("release"))
    fault.clean()
    measure(trial, total())
    return trial


def measure(trial: Trial, total: int) -> None:
    """The trial's measures from its history (see the module's docstring)."""
    grants = {e.client: e.t1 for e in trial.events if e.op == "acquire" and e.result is not None}
    sections = {}
    for client, granted in grants.items():
        ends = [e.t0 for e in trial.events if e.client == client and e.op in ("write", "release")]
        sections[client] = (granted, max(ends))
    if len(sections) == 2:
        (s1, e1), (s2, e2) = sections.values()
        trial.overlapping = max(s1, s2) < min(e1, e2)
    for event in trial.events:
        if event.op != "write":
            continue
        own = grants[event.client]
        event.stale = any(own < other < event.t0 for client, other in grants.items()
                          if client != event.client)
        if event.result:
            trial.increments += 1
        if event.stale:
            if event.result:
                trial.stale_accepted += 1
            else:
                trial.stale_refused += 1
    trial.total = total
    trial.reissued = reissued(trial.events)


def reissued(events: list[Event]) -> int:
    """Grants whose token is not above every token granted before them in the trial: a
    token issued again (fencing tokens must only grow). Only whole-number tokens count
    (etcd's revisions, distlock's tokens); Redis and Redlock's are random, not ordered."""
    top, again = None, 0
    for event in sorted(events, key=lambda e: e.t1):
        token = event.result
        if event.op != "acquire" or isinstance(token, bool) or not isinstance(token, int):
            continue
        if top is not None and token <= top:
            again += 1
        top = token if top is None else max(top, token)
    return again


@dataclass
class Cell:
    """One contender × scenario × fault on/off: its trials summed."""

    contender: str
    scenario: str
    fault: bool
    trials: int = 0
    overlapping: int = 0
    stale_accepted: int = 0
    stale_refused: int = 0
    increments: int = 0
    total: int = 0
    lost: int = 0
    reissued: int = 0
    timeline: dict[str, Any] | None = None

    def add(self, trial: Trial) -> None:
        self.trials += 1
        self.reissued += trial.reissued
        self.overlapping += trial.overlapping
        self.stale_accepted += trial.stale_accepted
        self.stale_refused += trial.stale_refused
        self.increments += trial.increments
        self.total += trial.total
        self.lost += trial.lost
        if self.timeline is None:
            self.timeline = {"events": [asdict(e) for e in trial.events],
                             "marks": trial.marks}


def run_cell(contender: str, scenario: str, servers: Servers, postgres: str, trials: int,
             ttl: float, pg: Any) -> tuple[Cell, Cell]:
    """``trials`` control and fault trials, interleaved, with fresh clients A and B."""
    a = Client("A", contender, servers.config(postgres, "A"), servers.prefix("A"))
    try:
        b = Client("B", contender, servers.config(postgres, "B"))
        try:
            fault = FAULTS[scenario](servers, a, servers.config(postgres, "A"))
            control, faulted = Cell(contender, scenario, False), Cell(contender, scenario, True)
            for _ in range(trials):
                for cell in (control, faulted):
                    cell.add(run_trial(a, b, fault, on=cell.fault, scenario=scenario, ttl=ttl,
                                       reset=pg.reset, total=pg.total))
            return control, faulted
        finally:
            b.close()
    finally:
        a.close()


def rate(contender: str, servers: Servers, postgres: str, seconds: float, ttl: float) -> float:
    """Acquire + release per second of one uncontended client process."""
    client = Client("rate", contender, servers.config(postgres))
    try:
        return float(client.call("rate", wait=seconds + 120, seconds=seconds,
                                 ttl=ttl)["result"])
    finally:
        client.close()
