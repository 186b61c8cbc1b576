"""A private PgBouncer in transaction pooling mode, and the proof that nothing strands on it.

Used by ``scripts/pgbouncer`` (CI's PgBouncer step: start, run the suite through it, stop)
and by the suite's PgBouncer pass (tests/conftest.py; DISTLOCK_TEST_PGBOUNCER).

PgBouncer is Debian's package (``apt-get install pgbouncer``); nothing here installs it.
It refuses to start as root ("PgBouncer should not run as root"), so as root it is
started with ``-u`` and an unprivileged user, and its directory (config, auth file, log,
pid file: a fresh temporary directory) is given to that user. It runs in the foreground
as our child process, so stopping it is a signal to its PID and a wait, and nothing is
left to reap.

Why a transaction pooler is the hard case: a server connection goes back to the pool at
every COMMIT, and in transaction mode PgBouncer resets nothing (``server_reset_query``
is for session mode), so anything a client leaves on the *session* — LISTEN, a
session-level advisory lock, a prepared statement, an open transaction — stays on a
server connection that the next transaction of any other client gets. :func:`sweep`
looks at every server connection of the pool for exactly that.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from tests.support.helpers import wait_until

# distlock_listen's advisory lock key space (migration 0002): (1684825963 = "dlck", hash).
WAKEUP_CLASS = 1684825963
# distlock_queue's (distlock_queue): "someone is queued" (1684825969 = "dlcq", hash) and
# "this waiting session is alive" (1684825975 = "dlcw", pid).
QUEUE_CLASS = 1684825969
ALIVE_CLASS = 1684825975
# A queue entry's lock, held by its waiter (distlock_enqueue): (1684825957 = "dlce", entry).
ENTRY_CLASS = 1684825957
WAITING_CLASSES = [WAKEUP_CLASS, QUEUE_CLASS, ALIVE_CLASS]
# PgBouncer tracks protocol-level prepared statements per client from 1.21
# (max_prepared_statements); before, a statement prepared by one client stays on the server
# connection for whoever gets it next.
PREPARED_STATEMENTS_FROM = (1, 21)


def executable() -> str | None:
    return shutil.which("pgbouncer") or next(
        (path for path in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(path)),
        None,
    )


def version(binary: str) -> tuple[int, int]:
    """(major, minor) of ``pgbouncer --version`` ("PgBouncer 1.18.0" -> (1, 18))."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True)
    found = re.search(r"PgBouncer (\d+)\.(\d+)", out.stdout)
    if not found:
        raise RuntimeError(f"pgbouncer --version said {out.stdout!r}: no version in it")
    return int(found[1]), int(found[2])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_as() -> str | None:
    """The user PgBouncer switches to (its ``-u``) when we are root, else None."""
    if os.geteuid() != 0:
        return None
    for name in (os.environ.get("DISTLOCK_PGBOUNCER_USER"), "postgres", "nobody"):
        if name:
            try:
                pwd.getpwnam(name)
                return name
            except KeyError:
                continue
    raise RuntimeError("running as root, and no user to run PgBouncer as (postgres, nobody)")


@dataclass
class Server:
    """Where a PostgreSQL server is, from a URL (postgresql://user@host:port/dbname)."""

    host: str
    port: int
    user: str
    password: str = ""

    @classmethod
    def from_url(cls, url: str) -> Server:
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 5432,
                   unquote(parts.username or "postgres"), unquote(parts.password or ""))

    def connect(self, dbname: str) -> Any:
        import psycopg

        return psycopg.connect(host=self.host, port=self.port, user=self.user,
                               password=self.password, dbname=dbname, autocommit=True)


@dataclass
class PgBouncer:
    """A running PgBouncer (see :func:`start`)."""

    process: subprocess.Popen[bytes]
    directory: Path
    port: int
    server: Server
    version: tuple[int, int]
    prepared_statements: int

    @property
    def pid(self) -> int:
        return self.process.pid

    def url(self, dbname: str) -> str:
        """A client URL for ``dbname`` through this PgBouncer."""
        return f"postgresql://{self.server.user}@127.0.0.1:{self.port}/{dbname}"

    def client(self, dbname: str) -> Any:
        """A psycopg connection (autocommit) to ``dbname`` through this PgBouncer."""
        return Server("127.0.0.1", self.port, self.server.user).connect(dbname)

    def admin(self, command: str) -> list[dict[str, Any]]:
        """A command on PgBouncer's admin console (SHOW SERVERS, KILL db, ...), as rows."""
        return admin(self.port, self.server.user, command)

    def log(self) -> str:
        path = self.directory / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to its PID (PgBouncer's immediate shutdown), wait, remove its directory."""
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.process.wait(timeout)
        shutil.rmtree(self.directory, ignore_errors=True)


def admin(port: int, user: str, command: str) -> list[dict[str, Any]]:
    """Run ``command`` on the admin console of the PgBouncer at 127.0.0.1:``port``."""
    with Server("127.0.0.1", port, user).connect("pgbouncer") as console:
        cursor = console.execute(command)
        if cursor.description is None:
            return []
        names = [column.name for column in cursor.description]
        return [dict(zip(names, values, strict=True)) for values in cursor.fetchall()]


def start(server_url: str, *, port: int | None = None) -> PgBouncer:
    """Start PgBouncer on 127.0.0.1 (``port``, or a free one) in front of ``server_url``.

    ``pool_mode = transaction``; a wildcard ``[databases]`` entry, so every database of
    the server is reachable by its own name (Django creates and drops its test database
    through it, connected to ``postgres``); ``auth_type = trust`` with the server's user
    in the auth file (the test server trusts 127.0.0.1). From PgBouncer 1.21 it tracks
    prepared statements (``max_prepared_statements = 100``); before, it cannot.
    """
    binary = executable()
    if binary is None:
        raise RuntimeError("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    server = Server.from_url(server_url)
    found = version(binary)
    prepared = 100 if found >= PREPARED_STATEMENTS_FROM else 0
    user = _run_as()
    for attempt in range(5):
        directory = Path(tempfile.mkdtemp(prefix="distlock-pgbouncer-"))
        chosen = port or _free_port()
        _write_config(directory, chosen, server, prepared)
        command = [binary, *(["-u", user] if user else []), str(directory / "pgbouncer.ini")]
        if user:
            for path in (directory, *directory.iterdir()):
                shutil.chown(path, user)
        # In the foreground PgBouncer also logs to stderr: to a file, never to a pipe
        # nobody reads (a full pipe would stop it).
        with open(directory / "stderr.log", "wb") as stderr:
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        bouncer = PgBouncer(process, directory, chosen, server, found, prepared)
        if _ready(bouncer):
            return bouncer
        log = bouncer.log() + (directory / "stderr.log").read_text(errors="replace")
        bouncer.stop()
        # A free port taken by someone else between our probe and PgBouncer's bind.
        if port is None and "Address already in use" in log and attempt < 4:
            continue
        raise RuntimeError(f"pgbouncer did not start on 127.0.0.1:{chosen}:\n{log}")
    raise AssertionError("unreachable")


def _write_config(directory: Path, port: int, server: Server, prepared: int) -> None:
    (directory / "userlist.txt").write_text(f'"{server.user}" "{server.password}"\n')
    settings = {
        "listen_addr": "127.0.0.1",
        "listen_port": port,
        "unix_socket_dir": "",
        "auth_type": "trust",
        "auth_file": directory / "userlist.txt",
        "admin_users": server.user,
        "pool_mode": "transaction",
        "default_pool_size": 20,
        # The suite's process tests start dozens of clients; PgBouncer queues clients
        # beyond the pool, it does not refuse them.
        "max_client_conn": 500,
        # The suite opens thousands of connections: log the problems, not each one.
        "log_connections": 0,
        "log_disconnections": 0,
        "logfile": directory / "pgbouncer.log",
        "pidfile": directory / "pgbouncer.pid",
    }
    if prepared:
        settings["max_prepared_statements"] = prepared
    lines = ["[databases]", f"* = host={server.host} port={server.port}", "", "[pgbouncer]"]
    lines += [f"{key} = {value}" for key, value in settings.items()]
    (directory / "pgbouncer.ini").write_text("\n".join(lines) + "\n")


def _ready(bouncer: PgBouncer) -> bool:
    """Wait until PgBouncer answers on its admin console; False if it exited first."""

    def answers() -> bool | None:
        if bouncer.process.poll() is not None:
            return True  # ends the wait: it will never answer
        try:
            bouncer.admin("SHOW VERSION")
        except Exception:  # noqa: BLE001 - not listening yet
            return None
        return True

    wait_until(answers, timeout=15, what="pgbouncer answering on its admin console")
    return bouncer.process.poll() is None


# -- the proof: nothing of distlock's stranded on a pooled server connection -------------


@dataclass
class Sweep:
    """What :func:`sweep` saw: the server connections it inspected, and what was left."""

    servers: list[int] = field(default_factory=list)
    stranded: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{len(self.servers)} pooled server connection(s) inspected; left behind: "
                + ("; ".join(self.stranded) or "nothing"))


# Per server connection, from inside it: what a client left on the session.
_SESSION_STATE = """
SELECT pg_backend_pid(),
       ARRAY(SELECT pg_listening_channels()),
       ARRAY(SELECT format('%%s/%%s/%%s', classid, objid, mode) FROM pg_locks
             WHERE locktype = 'advisory' AND pid = pg_backend_pid()),
       ARRAY(SELECT name FROM pg_prepared_statements),
       ARRAY(SELECT format('%%s = %%s', name, current_setting(name)) FROM pg_settings
             WHERE source = 'session' AND lower(name) NOT IN (SELECT unnest(%s::text[])))
"""
# The parameters PgBouncer itself sets on a server connection for each client it links.
_TRACKED = ["client_encoding", "datestyle", "timezone", "standard_conforming_strings",
            "application_name"]


def sweep(bouncer_port: int, server: Server, dbname: str, *, reset: bool = False) -> Sweep:
    """Inspect every server connection PgBouncer holds to ``dbname`` for session state.

    ``pg_listening_channels()`` and ``pg_prepared_statements`` answer only for the session
    that asks, so the question must run *on* each pooled server connection: one client
    after another opens a transaction, which pins an idle server connection to it, and
    asks there (LISTEN, advisory locks, prepared statements, settings changed by SET),
    until PgBouncer's ``SHOW SERVERS`` lists no idle server connection of ``dbname`` that
    was not asked. One still linked to another client is reported, not borrowed. Then, on
    the server directly: no distlock advisory lock in ``pg_locks`` and no session left
    idle in a transaction, in ``dbname`` (other databases of a shared server are not
    looked at: their own waiters hold such locks rightly). ``reset`` clears what it finds
    (UNLISTEN *, the advisory locks, DEALLOCATE ALL, RESET ALL), for a test that strands
    something on purpose.
    """

    result = Sweep()
    clients: list[Any] = []
    try:
        while True:
            # remote_pid 0: a server connection still logging in, with no session yet.
            rows = [row for row in admin(bouncer_port, server.user, "SHOW SERVERS")
                    if row["database"] == dbname and row["remote_pid"]]
            # "active": linked to a client (ours, or one still in a transaction).
            free = {row["remote_pid"] for row in rows if row["state"] != "active"}
            if free <= set(result.servers):
                busy = {row["remote_pid"] for row in rows} - set(result.servers)
                result.stranded += [f"server pid {pid}: still linked to a client"
                                    for pid in sorted(busy)]
                break
            if len(clients) > len(rows) + 20:
                raise AssertionError(f"sweep: could not reach the server connections "
                                     f"{sorted(free - set(result.servers))} of {dbname}")
            client = Server("127.0.0.1", bouncer_port, server.user).connect(dbname)
            clients.append(client)
            client.autocommit = False  # the open transaction keeps this server connection
            pid, channels, advisory, prepared, changed = client.execute(
                _SESSION_STATE, [_TRACKED]
            ).fetchone()
            result.servers.append(pid)
            left = [f"LISTEN {', '.join(channels)}" if channels else "",
                    f"advisory locks {', '.join(advisory)}" if advisory else "",
                    f"prepared statements {', '.join(prepared)}" if prepared else "",
                    f"SET {', '.join(changed)}" if changed else ""]
            if any(left):
                result.stranded.append(f"server pid {pid}: " + ", ".join(filter(None, left)))
                if reset:
                    client.execute("UNLISTEN *")
                    client.execute("SELECT pg_advisory_unlock_all()")
                    client.execute("DEALLOCATE ALL")
                    client.execute("RESET ALL")
    finally:
        for client in clients:
            # Ended here, not left to the close: PgBouncer would end a transaction of a
            # client that went away on its own time, after the check below had seen it.
            # Committed only when reset changed something.
            if reset:
                client.commit()
            else:
                client.rollback()
            client.close()
    with server.connect("postgres") as direct:
        for pid, datname, classid, objid, mode in direct.execute(
            "SELECT pid, datname, classid, objid, mode FROM pg_locks JOIN pg_database d "
            "ON d.oid = pg_locks.database WHERE locktype = 'advisory' "
            "AND classid = ANY(%s::oid[]) AND datname = %s",
            [WAITING_CLASSES, dbname],
        ):
            if pid in result.servers:
                continue  # reported from inside that session above
            result.stranded.append(f"server pid {pid} ({datname}): distlock advisory lock "
                                   f"{classid}/{objid} {mode}")
        for pid, query in direct.execute(
            "SELECT pid, query FROM pg_stat_activity WHERE datname = %s "
            "AND state LIKE 'idle in transaction%%'", [dbname],
        ):
            result.stranded.append(f"server pid {pid}: idle in transaction after {query!r}")
    return result
