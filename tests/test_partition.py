"""A network partition between a lock holder's host and the database (S5, S7).

Two "hosts" are network namespaces joined to this machine by veth pairs
(lab/netns.py, named per run); a private PostgreSQL server (tests/support/pg_clusters.py)
listens on the root ends. Host A runs a holder process and a probe, host B a holder,
each a real Python process started with ``ip netns exec`` (tests/support/
partition_workers.py), reaching the database only over its own link.

A takes a short lease and makes a fenced write (the stress harness's: Resource +1 and its
ground-truth Write row in one transaction); then a second one, and while its transaction
is open A's link goes down (``ip link set … down``: every packet either way dropped,
nothing reset). The COMMIT's fate is what A never learns, in two ways:

* ``commit lost``: A sends COMMIT after the cut; it never reaches the server, whose
  backend for A sits idle in its transaction — holding the fenced check's shared lock on
  the lock row, which a take-over must wait for — until the server's TCP keepalives give
  up on A and roll it back;
* ``reply lost``: A's COMMIT reaches the server and waits there at a gate (a deferred
  trigger waiting for an advisory lock the test holds); the link goes down, the test
  opens the gate, the server commits, and its answer is dropped.

A's blocked call fails within the bound its connection settings give it (``BOUNDED``:
``tcp_user_timeout`` while data is unacknowledged, keepalives while it waits for an
answer), and a reconnect during the cut within ``connect_timeout``; the probe on the same
host, with the driver's defaults, is still blocked when the test restores the link. B
acquires once A's lease has expired by the database clock, and writes — with the commit
lost, only once the server has dropped A's session and rolled back its open transaction
(A's sessions ask the server for bounds longer than its lease, ``A_OPTIONS``, so that
this wait shows). After the link is
restored, A's fenced write is refused, its renewal raises LockLost and its release
returns False. The history checker (tests/stress/checker.py) judges the lock history,
the table and the clients' histories, A's in-flight write being indeterminate:
violations = 0, and the write applied in one resolution and absent in the other.

Each run prints its history summary and measured times (-s or -rA shows them). Runs in
the PostgreSQL pass; a machine that cannot make network namespaces skips it, except with
CI=true or DISTLOCK_REQUIRE_NETNS=1, where it fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab import netns
from lab.netns import Host
from tests.stress import checker
from tests.stress.harness import HISTORY, trigger_statements
from tests.support.helpers import wait_until
from tests.support.namespaces import need_netns
from tests.support.pg_clusters import Server, django_env, stop_leftovers
from tests.support.processes import Child, Children

pytestmark = [
    pytest.mark.slow,
    pytest.mark.processes,
    pytest.mark.no_pooler("runs its own PostgreSQL server on veth addresses: no pooler"),
]

if os.environ.get("DISTLOCK_TEST_BACKEND") != "postgresql":
    pytest.skip(
        "the partition test runs in the PostgreSQL pass (DISTLOCK_TEST_BACKEND=postgresql): "
        "it builds its own PostgreSQL server behind network namespaces",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parent.parent
NAME = "partition"
TTL = 3.0
# The holders' connection settings (libpq's names, Django's OPTIONS): what
# docs/deployment.md recommends, tightened to test scale.
BOUNDED = {
    "connect_timeout": 2, "keepalives": 1, "keepalives_idle": 1, "keepalives_interval": 1,
    "keepalives_count": 2, "tcp_user_timeout": 2000,
}
# The server's side of the same: how soon it drops a cut-off client's session (and the
# row locks of its open transaction).
SERVER_SETTINGS = (
    "tcp_keepalives_idle = 1\ntcp_keepalives_interval = 1\ntcp_keepalives_count = 2\n"
    "tcp_user_timeout = 2000\n"
)
# A's own sessions ask the server for longer bounds (keepalive idle 4 s, unacknowledged
# data 6 s) than A's 3 s lease, so that with the commit lost the take-over has to wait for
# the server to drop them.
A_OPTIONS = {**BOUNDED, "options": "-c tcp_keepalives_idle=4 -c tcp_user_timeout=6000"}
GATE = 2316  # the advisory lock key of the COMMIT gate
GATE_SQL = [
    "CREATE FUNCTION partition_gate() RETURNS trigger LANGUAGE plpgsql AS "
    f"$$ BEGIN PERFORM pg_advisory_xact_lock_shared({GATE}); RETURN NULL; END $$",
    "CREATE CONSTRAINT TRIGGER partition_gate AFTER INSERT ON stressapp_write "
    "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION partition_gate()",
]
VOLUME = checker.Volume(grants=2, writes=2, stale_refused=1)


# -- the machines ----------------------------------------------------------------------------


@pytest.fixture
def hosts() -> Iterator[dict[str, Host]]:
    need_netns("the partition test")
    netns.remove_leftovers()
    stop_leftovers("partition")
    made = {"a": Host("a"), "b": Host("b")}
    try:
        for host in made.values():
            host.create()
        yield made
    finally:
        for host in made.values():
            host.remove()


@pytest.fixture
def server(hosts: dict[str, Host]) -> Iterator[Server]:
    database = Server(SERVER_SETTINGS, label="partition",
                      listen=[host.gateway for host in hosts.values()],
                      networks=[netns.NETWORK])
    try:
        database.start()
        database.migrate()
        for statement in [*trigger_statements("postgresql"), *GATE_SQL]:
            database.query(statement)
        database.query("INSERT INTO stressapp_resource (name, value, version, fence_token) "
                       "VALUES (%s, 0, 0, 0)", [NAME])
        yield database
    finally:
        database.stop()


@pytest.fixture
def processes(server: Server) -> Iterator[Children]:
    """The hosts' processes: killed (by PID) before the server and the hosts go."""
    group = Children()
    try:
        yield group
    finally:
        group.close()


def start(group: Children, server: Server, host: Host, role: str, *args: Any,
          options: dict[str, Any]) -> Child:
    env = django_env(server.url(), HOST=host.gateway,
                     **({"OPTIONS": options} if options else {}))
    child = group.start(f"tests.support.partition_workers:{role}", *args, env=env,
                        prefix=host.prefix())
    child.expect("ready", timeout=60)
    return child


@contextlib.contextmanager
def gate(server: Server) -> Iterator[None]:
    """COMMITs of fenced writes wait on the server while this holds the gate's lock."""
    with server.connect(local=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", [GATE])
        yield
        holder.execute("SELECT pg_advisory_unlock(%s)", [GATE])


# -- the clients' histories, in the checker's terms ------------------------------------------


class History:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def acquired(self, worker: str, got: dict[str, Any]) -> None:
        self.events.append({"type": "acquire", "status": "ok", "worker": worker, "lock": NAME,
                            "token": got["token"], "owner": got["owner"],
                            "expires_us": got["expires_us"]})

    def wrote(self, worker: str, op_id: str, token: int, got: dict[str, Any]) -> None:
        status = {"written": "ok", "stale": "rejected", "dberror": "info"}[got["event"]]
        self.events.append({"type": "write", "status": status, "worker": worker,
                            "lock": NAME, "op_id": op_id, "token": token})


def ask(child: Child, command: str, **data: Any) -> dict[str, Any]:
    """A command after the link came back: once more if the first call only found the
    connection the cut broke (the next one reconnects)."""
    for _ in range(2):
        child.send(command, **data)
        got = child.next_event(30)
        if got["event"] != "dberror":
            return got
    raise AssertionError(f"{child.role}'s {command} failed twice: {got}")


# -- the test --------------------------------------------------------------------------------


@pytest.mark.parametrize("lost", ["commit", "reply"], ids=["commit-lost", "reply-lost"])
def test_a_cut_off_holder_is_fenced_after_the_take_over(lost, hosts, server, processes,
                                                        capsys):
    a_host = hosts["a"]
    a = start(processes, server, a_host, "holder", "A", NAME, options=A_OPTIONS)
    b = start(processes, server, hosts["b"], "holder", "B", NAME, options=BOUNDED)
    probe = start(processes, server, a_host, "probe", "P", options={})
    history = History()

    a.send("acquire", ttl=TTL, timeout=5)
    lease_a = a.expect("acquired")
    history.acquired("A", lease_a)
    a.send("write", op_id="A:1")
    history.wrote("A", "A:1", lease_a["token"], a.expect("written"))
    a.send("write", op_id="A:2", wait=True)
    a.expect("uncommitted")

    if lost == "commit":
        a_host.cut()
        cut_at = time.monotonic()
        a.send("commit")
    else:
        with gate(server):
            a.send("commit")
            wait_until(lambda: server.query(
                "SELECT 1 FROM pg_stat_activity WHERE application_name = "
                "'distlock-worker-host-A' AND wait_event = 'advisory'"), 10,
                "A's COMMIT to wait at the gate", every=0.02)
            a_host.cut()
            cut_at = time.monotonic()
        # The gate is open: the server commits A's write; its answer is dropped.
        wait_until(lambda: server.query(
            "SELECT 1 FROM stressapp_write WHERE op_id = 'A:2'"), 10,
            "A's write to be committed", every=0.02)
    probe.send("query")  # with libpq's defaults, on the cut link
    b.send("acquire", ttl=10, timeout=20)

    # A's blocked COMMIT fails within its connection settings' bound: indeterminate.
    failed = a.expect("dberror", timeout=20)
    history.wrote("A", "A:2", lease_a["token"], failed)
    # A reconnect while cut off fails within connect_timeout.
    a.send("renew")
    reconnect = a.expect("dberror", timeout=20)

    lease_b = b.expect("acquired", timeout=30)
    history.acquired("B", lease_b)
    assert lease_b["token"] > lease_a["token"]
    assert lease_b["acquired_us"] >= lease_a["expires_us"]
    waited = (lease_b["acquired_us"] - lease_a["expires_us"]) / 1e6
    if lost == "commit":
        # A's transaction was open on the server, its fenced check's shared lock on the
        # lock row with it: B's grant waited for the server to drop A's session.
        assert waited > 1.0, waited
    else:
        assert waited < 1.0, waited
    b.send("write", op_id="B:1")
    history.wrote("B", "B:1", lease_b["token"], b.expect("written"))
    # The server gives up on A's session (keepalives / tcp_user_timeout); until then a
    # transaction A left open keeps its row locks (with the commit lost, B waited for it).
    wait_until(lambda: not server.query(
        "SELECT 1 FROM pg_stat_activity WHERE application_name = 'distlock-worker-host-A'"),
        20, "the server to drop A's session", every=0.02)
    dropped_after = time.monotonic() - cut_at

    # The probe on the same host, with the driver's defaults, is still blocked.
    blocked_for = time.monotonic() - cut_at
    assert probe.events.empty(), probe.events.queue
    assert blocked_for > failed["seconds"]
    a_host.restore()
    restored_at = time.monotonic()
    answer = probe.next_event(timeout=60)
    probe_after_restore = time.monotonic() - restored_at

    # Back on the network: A's fenced write is refused, the lease is lost, and the
    # release says A no longer held it.
    refused = ask(a, "write", op_id="A:3")
    assert refused["event"] == "stale", refused
    history.wrote("A", "A:3", lease_a["token"], refused)
    assert ask(a, "renew")["event"] == "lost"
    released = ask(a, "release")
    assert released == {**released, "event": "released", "held": False}

    report = checker.check(
        lock_history=server.rows(HISTORY), writes=server.rows("stressapp_write"),
        resources={row["name"]: row for row in server.rows("stressapp_resource")},
        client=history.events, liveness={}, volume=VOLUME, live_within=0.0,
    )
    with capsys.disabled():
        print(
            f"\ndistlock partition [{lost} lost]: history: {report.summary()}\n"
            f"  A's blocked COMMIT failed {failed['seconds']:.1f} s after it was sent: "
            f"{failed['cause']}; "
            f"A's reconnect during the cut failed after {reconnect['seconds']:.1f} s: "
            f"{reconnect['cause']}; the server dropped A's session "
            f"{dropped_after:.1f} s after the cut; B granted "
            f"{waited:.3f} s after A's lease "
            f"expired (database clock); the probe with libpq's defaults still blocked "
            f"{blocked_for:.1f} s after the cut, then {answer['event']} "
            f"{probe_after_restore:.1f} s after the link came back (its call took "
            f"{answer['seconds']:.1f} s: {answer.get('cause', '')})"
        )
    assert report.ok, report.describe()
    assert (report.indeterminate, report.indeterminate_applied) == (1, int(lost == "reply"))
    assert report.stale_refused == 1
    # The bounds: tcp_user_timeout (2 s) for the unacknowledged COMMIT, keepalives
    # (1 s idle + 2 × 1 s) for the acknowledged one waiting for its answer; connect_timeout
    # 2 s. Generous margins: the point is seconds, not the kernel's minutes.
    assert failed["seconds"] < 8 and "timed out" in failed["cause"], failed
    assert reconnect["seconds"] < 5 and "timeout expired" in reconnect["cause"], reconnect
    # The probe heard nothing until the link came back.
    assert answer["seconds"] > failed["seconds"], answer


# -- the harness: names per run ---------------------------------------------------------------

# A run of its own (lab/netns.py's names per process): one host, its namespace's name
# printed, then it waits for a line on stdin and exits normally.
RUN = ("import sys; from lab import netns; host = netns.Host('x'); host.create(); "
       "print(host.namespace, host.outside, flush=True); sys.stdin.readline()")


def test_remove_leftovers_removes_only_a_dead_runs_names() -> None:
    """Two runs beside this one: one SIGKILLed (what a killed test run leaves), one alive.
    remove_leftovers() removes the dead run's namespace, link and record, and leaves the
    live run's and this run's own; the live run removes its own when it exits."""
    need_netns("the namespace harness's test")
    mine = Host("mine")
    mine.create()
    runs = [subprocess.Popen([sys.executable, "-c", RUN], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=str(ROOT))) for _ in range(2)]
    try:
        (dead_ns, dead_link), (live_ns, live_link) = (
            run.stdout.readline().split() for run in runs if run.stdout is not None)
        runs[0].kill()
        runs[0].wait(timeout=30)
        assert dead_ns in netns.namespaces() and dead_link in netns.links()
        removed = netns.remove_leftovers()
        assert removed == [dead_ns[len(netns.PREFIX):].split("-")[0]]
        assert dead_ns not in netns.namespaces() and dead_link not in netns.links()
        assert live_ns in netns.namespaces() and live_link in netns.links()
        assert mine.namespace in netns.namespaces() and mine.linked()
        assert runs[1].stdin is not None
        runs[1].stdin.write("\n")
        runs[1].stdin.flush()
        assert runs[1].wait(timeout=30) == 0
        assert live_ns not in netns.namespaces() and live_link not in netns.links()
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
            run.wait(timeout=30)
            for pipe in (run.stdin, run.stdout):
                if pipe is not None:
                    pipe.close()
        mine.remove()
        netns.remove_leftovers()
