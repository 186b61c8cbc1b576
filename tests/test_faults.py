"""Database faults against a PRIVATE PostgreSQL server that this module starts itself.

Never the shared server: ``initdb`` + ``pg_ctl`` into a temporary folder, on a free port
on 127.0.0.1 (as the ``postgres`` user when the tests run as root, because initdb refuses
root). The lock users are real processes (tests/support/stress_workers.py:agent) whose Django
settings point at that server, directly or through a loopback TCP proxy of our own that
can stop forwarding (a partition) or cut every connection.

What must hold (DESIGN invariant 8, anchors-reliability.md S5–S7):

* a restart, fast or immediate (a crash), keeps committed leases, gives a client whose
  connection died a clean database error (and the next call reconnects), never a hang;
  tokens keep increasing across it;
* an acquire interrupted by a restart or by a killed backend, even during its COMMIT,
  yields an exception or a lease the database really has — never a phantom lease; a
  grant committed for a client that never heard of it blocks others for at most its ttl;
* a holder cut off by a partition cannot write once a newer holder took over, and a
  transaction it left open on the server cannot keep the lock row beyond
  ``idle_in_transaction_session_timeout``.

Runs in the PostgreSQL pass of the suite (DISTLOCK_TEST_BACKEND=postgresql), or with
DISTLOCK_TEST_FAULTS=1; needs the PostgreSQL server binaries (DISTLOCK_PG_BIN, default:
the newest /usr/lib/postgresql/*/bin); the server is tests/support/pg_clusters.py's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.support.helpers import wait_until
from tests.support.pg_clusters import Server, Unavailable
from tests.support.processes import Child, Children

pytestmark = [
    pytest.mark.slow,
    pytest.mark.processes,
    pytest.mark.no_pooler("runs its own PostgreSQL server: no pooler is in the way"),
]

WANTED = (
    os.environ.get("DISTLOCK_TEST_BACKEND") == "postgresql"
    or os.environ.get("DISTLOCK_TEST_FAULTS") == "1"
)
if not WANTED:
    pytest.skip(
        "database faults run in the PostgreSQL pass (DISTLOCK_TEST_BACKEND=postgresql) "
        "or with DISTLOCK_TEST_FAULTS=1",
        allow_module_level=True,
    )

psycopg = pytest.importorskip("psycopg")

# The server-side net under a partition (S5): an open transaction whose client went silent
# is ended, and its row locks with it.
SETTINGS = "idle_in_transaction_session_timeout = '3s'\n"


class Proxy:
    """A loopback TCP proxy that can stop forwarding (partition) or cut every connection."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        self.mutex = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self.mutex:
                self.sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                # A partition: hold what arrived, forward nothing, close nothing.
                while not self.flowing.wait(0.05):
                    if self.closed.is_set():
                        return
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def partition(self) -> None:
        self.flowing.clear()

    def heal(self) -> None:
        self.flowing.set()

    def cut(self) -> None:
        """Reset every open connection (a NAT or load balancer dropping them)."""
        with self.mutex:
            for sock in self.sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self.sockets.clear()

    def close(self) -> None:
        self.closed.set()
        self.flowing.set()
        self.cut()
        self.listener.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    try:
        pg = Server(SETTINGS)
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        pg.start()
        pg.migrate()
        yield pg
    finally:
        pg.stop()


@pytest.fixture
def agents(server: Server) -> Iterator[Agents]:
    group = Agents(server)
    try:
        yield group
    finally:
        group.close()


class Agents(Children):
    """Agent processes on the private server (directly or through a proxy)."""

    def __init__(self, server: Server) -> None:
        super().__init__()
        self.server = server
        self.proxies: list[Proxy] = []

    def start_agent(self, label: str, name: str, proxy: Proxy | None = None) -> Child:
        child = self.start(
            "tests.support.stress_workers:agent", label, name,
            env=self.server.env(proxy.port if proxy else None),
        )
        child.expect("ready", timeout=60)
        return child

    def proxy(self) -> Proxy:
        proxy = Proxy(self.server.port)
        self.proxies.append(proxy)
        return proxy

    def close(self) -> None:
        super().close()
        for proxy in self.proxies:
            proxy.close()


def send(agent: Child, command: str, **data) -> None:
    agent.send(command, **data)


def outcome(agent: Child, timeout: float = 30.0) -> dict:
    """The agent's next event, whatever it is (expect() insists on one kind)."""
    return agent.next_event(timeout)


def make_free_row(server: Server, name: str) -> int:
    """Create lock ``name`` free, with a resource row; return its token."""
    server.query(
        "INSERT INTO distlock_lock (name, token, owner, holder, acquired_us, renewed_us, "
        "expires_us, renew_count) SELECT %s, COALESCE(MAX(token), 0) + 1, '', '', NULL, "
        "NULL, 0, 0 FROM distlock_lock", [name],
    )
    server.query(
        "INSERT INTO stressapp_resource (name, value, version, fence_token) "
        "VALUES (%s, 0, 0, 0)", [name],
    )
    return server.lock_row(name)["token"]


def resource(server: Server, name: str) -> tuple[int, int]:
    return server.query(
        "SELECT value, fence_token FROM stressapp_resource WHERE name = %s", [name]
    )[0]


# -- restarts ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_restart_keeps_a_held_lease_and_the_holder_reconnects(server, agents, mode):
    name = f"restart-held-{mode}"
    make_free_row(server, name)
    holder = agents.start_agent("H", name)
    send(holder, "acquire", ttl=20)
    held = holder.expect("acquired")

    server.restart(mode)

    # The holder's connection died with the server: its next call fails cleanly (or has
    # already reconnected); the one after works, and the lease is still its own.
    send(holder, "renew")
    first = outcome(holder)
    if first["event"] == "dberror":
        assert first["kind"] in ("OperationalError", "InterfaceError"), first
        send(holder, "renew")
        first = outcome(holder)
    assert first["event"] == "renewed" and first["token"] == held["token"], first
    row = server.lock_row(name)
    assert (row["owner"], row["token"]) == (held["owner"], held["token"])
    assert row["expires_us"] > row["now_us"]

    other = agents.start_agent("O", name)
    send(other, "acquire", ttl=5)
    assert outcome(other)["event"] == "busy", "a committed lease was lost in the restart"
    send(holder, "release")
    assert holder.expect("released")["held"] is True
    send(other, "acquire", ttl=5)
    assert other.expect("acquired")["token"] == held["token"] + 1


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_restart_during_acquire_gives_an_error_never_a_phantom(server, agents, mode):
    name = f"restart-acquire-{mode}"
    token = make_free_row(server, name)
    waiter = agents.start_agent("W", name)
    blocker = server.connect()
    try:
        # Keep the (free) row locked, so the acquire waits inside its transaction.
        blocker.execute("SET idle_in_transaction_session_timeout = 0")
        blocker.autocommit = False
        blocker.execute("SELECT 1 FROM distlock_lock WHERE name = %s FOR UPDATE", [name])
        send(waiter, "acquire", ttl=5, timeout=60)
        wait_until(lambda: server.backend("W", wait_event_type="Lock"), 30,
                   "the acquire waiting on the row lock", every=0.05)
        server.restart(mode)
    finally:
        with contextlib.suppress(Exception):
            blocker.close()
    got = outcome(waiter)
    assert got["event"] == "dberror", f"expected a clean error, got {got}"
    assert got["kind"] in ("OperationalError", "InterfaceError"), got
    row = server.lock_row(name)
    assert (row["owner"], row["token"]) == ("", token), "the interrupted acquire was granted"

    send(waiter, "acquire", ttl=5, timeout=30)
    again = waiter.expect("acquired")
    assert again["token"] == token + 1
    row = server.lock_row(name)
    assert (row["owner"], row["token"]) == (again["owner"], again["token"])


def test_a_release_lost_in_a_crash_only_keeps_the_lock_until_its_lease_ends(server, agents):
    """A release commits without waiting for its WAL flush (DISTLOCK_DURABLE_RELEASE off):
    a crash right after it may undo it. Then the lock is held by the lease that released
    it, until that lease's expiry, and the next grant's token is still one higher — never
    a free lock that forgot its token, nor a grant that outlived its release."""
    name = "crash-after-release"
    token = make_free_row(server, name)
    # The WAL writer would write the release out within 200 ms; give the crash the time.
    server.query("ALTER SYSTEM SET wal_writer_delay = '10s'")
    server.query("SELECT pg_reload_conf()")
    holder = agents.start_agent("H", name)
    try:
        send(holder, "acquire", ttl=3)
        held = holder.expect("acquired")
        assert held["token"] == token + 1
        send(holder, "release")
        assert holder.expect("released")["held"] is True
        server.restart("immediate")
    finally:
        server.query("ALTER SYSTEM RESET wal_writer_delay")
        server.query("SELECT pg_reload_conf()")
    row = server.lock_row(name)
    assert row["token"] == held["token"], row
    assert row["owner"] in ("", held["owner"]), row
    lost = row["owner"] == held["owner"]
    if lost:
        assert row["expires_us"] == held["expires_us"], "the lease came back changed"
    other = agents.start_agent("O", name)
    send(other, "acquire", ttl=5, timeout=30)
    got = other.expect("acquired", timeout=40)
    assert got["token"] == held["token"] + 1
    if lost:
        # Not before the released lease's own expiry, by the database clock.
        assert got["acquired_us"] >= held["expires_us"]
    print(f"release {'lost' if lost else 'kept'} by the crash")


# -- a connection killed during COMMIT -------------------------------------------------------

SLOW_COMMIT = """
CREATE OR REPLACE FUNCTION distlock_test_slow_commit() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.name LIKE 'slow-commit%%' THEN PERFORM pg_sleep(2); END IF;
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS distlock_test_slow_commit ON distlock_lock;
CREATE CONSTRAINT TRIGGER distlock_test_slow_commit AFTER UPDATE ON distlock_lock
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION distlock_test_slow_commit();
"""


@pytest.fixture
def slow_commit(server: Server) -> Iterator[None]:
    """A test-only deferred trigger: the acquire's COMMIT sleeps 2 s (the window to kill)."""
    with server.connect() as connection:
        connection.execute(SLOW_COMMIT.replace("%%", "%"))
    try:
        yield
    finally:
        with server.connect() as connection:
            connection.execute("DROP TRIGGER IF EXISTS distlock_test_slow_commit ON distlock_lock")


def test_backend_terminated_during_commit_is_an_error_and_no_grant(server, agents, slow_commit):
    name = "slow-commit-terminate"
    token = make_free_row(server, name)
    client = agents.start_agent("C", name)
    send(client, "acquire", ttl=5, timeout=0)
    pid = wait_until(lambda: server.backend("C", wait_event="PgSleep"), 30,
                     "the acquire sleeping inside its COMMIT", every=0.05)
    assert server.query("SELECT pg_terminate_backend(%s)", [pid]) == [(True,)]
    got = outcome(client)
    assert got["event"] == "dberror", f"expected a clean error, got {got}"
    row = server.lock_row(name)
    assert (row["owner"], row["token"]) == ("", token), "a terminated COMMIT left a grant"

    send(client, "acquire", ttl=5, timeout=0)
    again = client.expect("acquired")
    row = server.lock_row(name)
    assert (row["owner"], row["token"]) == (again["owner"], again["token"]) == (
        again["owner"], token + 1,
    )


def test_connection_cut_during_commit_leaves_at_most_a_ghost_that_expires(
    server, agents, slow_commit
):
    """The reply is lost but the COMMIT went through: the client must not think it holds
    the lock, and the grant nobody knows about blocks others for at most its ttl."""
    name = "slow-commit-cut"
    token = make_free_row(server, name)
    proxy = agents.proxy()
    client = agents.start_agent("X", name, proxy=proxy)
    send(client, "acquire", ttl=3, timeout=0)
    wait_until(lambda: server.backend("X", wait_event="PgSleep"), 30,
               "the acquire sleeping inside its COMMIT", every=0.05)
    proxy.cut()
    got = outcome(client)
    assert got["event"] == "dberror", f"a cut connection must raise, got {got}"
    # The server finished the COMMIT it was in: a grant exists that no client holds.
    ghost = wait_until(
        lambda: (row := server.lock_row(name))["token"] == token + 1 and row, 15,
        "the COMMIT to finish on the server", every=0.05,
    )
    assert ghost["owner"] != "" and ghost["expires_us"] - ghost["acquired_us"] == 3_000_000

    other = agents.start_agent("Y", name)
    send(other, "acquire", ttl=5, timeout=20)
    taken = other.expect("acquired", timeout=40)
    assert taken["token"] == token + 2
    assert taken["acquired_us"] >= ghost["expires_us"], "the ghost grant was ignored"
    assert taken["acquired_us"] - ghost["expires_us"] < 5_000_000, "blocked beyond its ttl"


# -- partitions ------------------------------------------------------------------------------


def test_partitioned_holder_cannot_write_after_a_takeover(server, agents):
    name = "partition-write"
    make_free_row(server, name)
    proxy = agents.proxy()
    stale = agents.start_agent("P", name, proxy=proxy)
    send(stale, "acquire", ttl=1.5)
    old = stale.expect("acquired")

    proxy.partition()
    send(stale, "write")  # stuck in the partition until it heals
    fresh = agents.start_agent("F", name)
    send(fresh, "acquire", ttl=20, timeout=30)
    new = fresh.expect("acquired", timeout=40)
    assert new["token"] == old["token"] + 1
    assert new["acquired_us"] >= old["expires_us"]
    send(fresh, "write")
    assert fresh.expect("written")["token"] == new["token"]

    proxy.heal()
    late = outcome(stale, timeout=40)
    assert late["event"] == "stale", f"the partitioned holder's write was not refused: {late}"
    assert resource(server, name) == (1, new["token"])
    send(stale, "release")
    assert stale.expect("released")["held"] is False
    assert server.lock_row(name)["owner"] == new["owner"]
    send(fresh, "release")
    assert fresh.expect("released")["held"] is True


def test_transaction_left_open_by_a_partition_cannot_keep_the_lock(server, agents):
    """The holder's fenced write is in flight (row lock on the lock row) when its network
    goes silent; idle_in_transaction_session_timeout ends it and the lock moves on."""
    name = "partition-open-tx"
    make_free_row(server, name)
    proxy = agents.proxy()
    stuck = agents.start_agent("S", name, proxy=proxy)
    send(stuck, "acquire", ttl=1.5)
    old = stuck.expect("acquired")
    send(stuck, "write_and_wait")
    stuck.expect("uncommitted")
    proxy.partition()
    send(stuck, "commit")  # the COMMIT goes into the partition

    fresh = agents.start_agent("T", name)
    send(fresh, "acquire", ttl=20, timeout=30)
    new = fresh.expect("acquired", timeout=40)
    assert new["token"] == old["token"] + 1
    assert resource(server, name) == (0, 0), "the cut-off transaction's write committed"
    send(fresh, "write")
    fresh.expect("written")

    proxy.heal()
    late = outcome(stuck, timeout=40)
    assert late["event"] == "dberror", f"the cut-off COMMIT must fail, got {late}"
    assert resource(server, name) == (1, new["token"])
    send(fresh, "release")
    assert fresh.expect("released")["held"] is True
