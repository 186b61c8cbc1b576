"""Throw-away PostgreSQL clusters on this machine: one server, or a primary and a standby.

Never the shared server: ``initdb`` into a temporary folder, on a free port on 127.0.0.1
only (and a Unix socket in that folder), run as the ``postgres`` OS user when the tests
run as root, because initdb refuses root. :class:`Server` is one cluster (the fault tests,
tests/test_faults.py); :class:`Replicated` is a primary with a streaming standby made by
``pg_basebackup -R`` (the failover tests, tests/test_failover.py). Whoever creates one
calls its ``close()``/``stop()`` in a ``finally``: the servers are stopped by ``pg_ctl`` (by
the postmaster's PID if that fails) and their folders removed, also after a failure.

A machine without what this needs (server binaries, a ``postgres`` user when root) raises
:class:`Unavailable`, with what is missing: the failover tests let it fail the run; the
fault tests turn it into a skip, as they always did.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.helpers import wait_until
from tests.support.processes import ROOT

DATABASE = "distlock"
# The standby's application_name on the primary (its cluster_name: pg_basebackup -R writes
# no application_name into primary_conninfo, so the walreceiver uses cluster_name).
STANDBY_NAME = "distlock_standby"
_CLOCK_US = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"


class Unavailable(RuntimeError):
    """This machine cannot run a private PostgreSQL server; the message says why."""


def pg_bin() -> Path:
    """The PostgreSQL server binaries: DISTLOCK_PG_BIN, else the newest
    /usr/lib/postgresql/*/bin (Debian's layout)."""
    if os.environ.get("DISTLOCK_PG_BIN"):
        found = Path(os.environ["DISTLOCK_PG_BIN"])
    else:
        versions = sorted(
            glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
        )
        if not versions:
            raise Unavailable(
                "PostgreSQL server binaries not found in /usr/lib/postgresql/*/bin "
                "(Debian package postgresql-15; or set DISTLOCK_PG_BIN)"
            )
        found = Path(versions[-1])
    for program in ("initdb", "pg_ctl", "pg_basebackup"):
        if not (found / program).exists():
            raise Unavailable(f"{found / program} does not exist (DISTLOCK_PG_BIN={found})")
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _server_user() -> pwd.struct_passwd | None:
    """The account the server runs as: ``postgres`` when we are root, else ourselves."""
    if os.geteuid() != 0:
        return None
    try:
        account = pwd.getpwnam("postgres")
    except KeyError:
        raise Unavailable("running as root and there is no postgres user for initdb") from None
    if shutil.which("runuser") is None:
        raise Unavailable("running as root and runuser (util-linux) is not installed")
    return account


def _connect(**params: Any) -> Any:
    import psycopg

    return psycopg.connect(autocommit=True, connect_timeout=10, **params)


class Server:
    """A throw-away PostgreSQL cluster on 127.0.0.1:<port>, database ``distlock``.

    ``settings`` are postgresql.conf lines added to the defaults below (later lines win).
    ``listen``: more addresses to listen on (the partition test's veth addresses), and
    ``networks``: the CIDRs whose clients it trusts besides 127.0.0.1.
    """

    def __init__(self, settings: str = "", label: str = "pg", *, listen: Sequence[str] = (),
                 networks: Sequence[str] = ()) -> None:
        self.bin = pg_bin()
        self.account = _server_user()
        self.settings = settings
        self.listen = tuple(listen)
        self.networks = tuple(networks)
        self.dir = Path(tempfile.mkdtemp(prefix=f"distlock-{label}-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = free_port()
        if self.account is not None:
            os.chown(self.dir, self.account.pw_uid, self.account.pw_gid)

    # -- running the server's programs ------------------------------------------------------

    def command(self, *args: str, timeout: float = 120) -> str:
        program = [str(self.bin / args[0]), *args[1:]]
        if self.account is not None:
            program = ["runuser", "-u", self.account.pw_name, "--", *program]
        done = subprocess.run(program, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
                f"\n{self.log.read_text() if self.log.exists() else ''}"
            )
        return done.stdout

    def pg_ctl(self, action: str, *extra: str) -> None:
        self.command("pg_ctl", action, "-D", str(self.data), "-l", str(self.log), "-w",
                     "-t", "60", *extra)

    def configure(self, lines: str) -> None:
        """Append to postgresql.conf (read at the next start or reload)."""
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(lines)

    def own_settings(self) -> str:
        return (
            f"\nlisten_addresses = '{','.join(('127.0.0.1', *self.listen))}'\n"
            f"port = {self.port}\n"
            f"unix_socket_directories = '{self.dir}'\n"
            # A crash here is the server process dying, never the machine: what the
            # server wrote is in the OS's cache either way.
            "fsync = off\nmax_connections = 50\nshared_buffers = 16MB\n"
            + self.settings
        )

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        """initdb, start, and create the database ``distlock``."""
        self.command(
            "initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
            "--no-sync", "--locale=C",
        )
        self.configure(self.own_settings())
        with open(self.data / "pg_hba.conf", "a") as hba:
            hba.writelines(f"host all all {network} trust\n" for network in self.networks)
        self.pg_ctl("start")
        with self.connect("postgres") as admin:
            admin.execute(f"CREATE DATABASE {DATABASE}")

    def restart(self, mode: str) -> None:
        self.pg_ctl("restart", "-m", mode)

    def crash(self) -> None:
        """Stop the server hard (``pg_ctl stop -m immediate``): no shutdown checkpoint,
        every client connection cut, as when the machine's database process dies."""
        self.pg_ctl("stop", "-m", "immediate")

    def stop(self) -> None:
        """Stop the server if it runs (by pg_ctl, else by the postmaster's PID) and remove
        its folder."""
        pid_file = self.data / "postmaster.pid"
        if pid_file.exists():
            try:
                self.pg_ctl("stop", "-m", "immediate")
            except Exception:  # noqa: BLE001 - the PID below still stops it
                with contextlib.suppress(OSError, ValueError, IndexError):
                    pid = int(pid_file.read_text().split()[0])
                    os.kill(pid, signal.SIGQUIT)
                    wait_until(lambda: not _alive(pid), 30, f"postmaster {pid} to exit")
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- talking to it -----------------------------------------------------------------------

    def url(self, port: int | None = None) -> str:
        return f"postgresql://postgres@127.0.0.1:{port or self.port}/{DATABASE}"

    def connect(self, dbname: str = DATABASE, *, local: bool = False) -> Any:
        """A psycopg connection (autocommit): over TCP, or with ``local`` over the Unix
        socket (which :meth:`refuse_tcp` leaves open)."""
        host = str(self.dir) if local else "127.0.0.1"
        return _connect(host=host, port=self.port, user="postgres", dbname=dbname)

    def query(self, sql: str, params: list[Any] | None = None, *,
              local: bool = False) -> list[tuple[Any, ...]]:
        with self.connect(local=local) as connection, connection.cursor() as cursor:
            cursor.execute(sql, params or [])
            return cursor.fetchall() if cursor.description else []

    def rows(self, table: str, *, local: bool = False) -> list[dict[str, Any]]:
        """Every row of ``table`` as a dict (the history checker's input)."""
        from psycopg.rows import dict_row

        with (
            self.connect(local=local) as connection,
            connection.cursor(row_factory=dict_row) as cursor,
        ):
            cursor.execute(f"SELECT * FROM {table}")
            return cursor.fetchall()

    def env(self, port: int | None = None) -> dict[str, str]:
        """Environment of a Django process that uses this server (or a proxy to it)."""
        return django_env(self.url(port))

    def migrate(self) -> None:
        migrate(self.env())

    def lock_row(self, name: str, *, local: bool = False) -> dict[str, Any] | None:
        found = self.query(
            f"SELECT token, owner, acquired_us, expires_us, {_CLOCK_US} "
            "FROM distlock_lock WHERE name = %s", [name], local=local,
        )
        if not found:
            return None
        token, owner, acquired_us, expires_us, now_us = found[0]
        return {"token": token, "owner": owner, "acquired_us": acquired_us,
                "expires_us": expires_us, "now_us": now_us}

    def backend(self, label: str, **state: str) -> int | None:
        """The pid of agent ``label``'s backend, optionally only in a given wait state."""
        where = " AND ".join(f"{key} = %s" for key in state)
        found = self.query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
            + (f" AND {where}" if where else ""),
            [f"distlock-worker-agent-{label}", *state.values()],
        )
        return found[0][0] if found else None

    # -- access control ----------------------------------------------------------------------

    def refuse_tcp(self) -> None:
        """Refuse every TCP client (pg_hba.conf, reloaded); the Unix socket stays open.

        What an operator does to keep the application off a promoted standby until the
        failover step has run (or leaves the virtual IP, DNS name or pooler pointing away).
        """
        self._hba("local all all trust\nhost all all 127.0.0.1/32 reject\n")

    def accept_tcp(self) -> None:
        self._hba("local all all trust\nhost all all 127.0.0.1/32 trust\n"
                  "host replication all 127.0.0.1/32 trust\n")

    def _hba(self, content: str) -> None:
        (self.data / "pg_hba.conf").write_text(content)
        self.query("SELECT pg_reload_conf()", local=True)


def stop_leftovers(label: str) -> None:
    """Stop the servers that a killed run left behind (by the postmaster's PID in each
    ``distlock-LABEL-*`` folder) and remove their folders, so a rerun starts clean."""
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"distlock-{label}-*")):
        pid_file = Path(folder) / "data" / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int(pid_file.read_text().split()[0])
            if "postgres" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                os.kill(pid, signal.SIGQUIT)
                wait_until(lambda pid=pid: not _alive(pid), 30, f"postmaster {pid} to exit")
        shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def django_env(url: str, **databases: Any) -> dict[str, str]:
    """Environment of a Django process (tests/settings.py) on database ``distlock`` at
    ``url``; ``databases`` are DATABASES["default"] keys that replace the URL's
    (DISTLOCK_TEST_DB_SETTINGS), e.g. a HOST and PORT list."""
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DISTLOCK_TEST_BACKEND": "postgresql",
        "DISTLOCK_TEST_POSTGRES": url,
        "DISTLOCK_TEST_CHILD_DB": DATABASE,
        "DISTLOCK_TEST_DB_SETTINGS": json.dumps(databases) if databases else "",
        # Straight to the private server, even from a pass through PgBouncer.
        "DISTLOCK_TEST_PGBOUNCER": "",
        "PYTHONPATH": str(ROOT),
    }
    return env


def manage(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -m django ARGS`` in a Django process with ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "django", *args], capture_output=True, text=True,
        timeout=timeout, cwd=ROOT, env={**os.environ, **env},
    )


def migrate(env: dict[str, str]) -> None:
    done = manage(env, "migrate", "--noinput", "-v", "0")
    assert done.returncode == 0, done.stderr


class Replicated:
    """A primary and a streaming standby (``pg_basebackup -R``) on this machine.

    ``synchronous``: the primary's ``synchronous_standby_names`` is the standby and
    ``synchronous_commit = on``, so a COMMIT returns only once the standby has flushed its
    WAL — a grant the client was told about is on the standby. Otherwise the standby
    streams asynchronously: a COMMIT returns at once, whatever the standby has.

    The application reaches whichever is the primary the way libpq does it, through a
    host list with ``target_session_attrs=read-write`` (:meth:`env`): before the failover
    the standby refuses to be the session (it is read-only), after its promotion it is
    the one that answers.
    """

    def __init__(self, *, synchronous: bool) -> None:
        self.synchronous = synchronous
        self.primary = Server(
            "wal_level = replica\nmax_wal_senders = 4\nwal_keep_size = '64MB'\n",
            label="primary",
        )
        self.standby: Server | None = None
        self._conninfo = ""  # the standby's primary_conninfo before cut_replication()

    def start(self) -> None:
        """Primary up and migrated, the standby cloned from it and streaming (in sync)."""
        primary = self.primary
        primary.start()
        primary.migrate()
        standby = self.standby = Server(label="standby")
        primary.command(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
            "-D", str(standby.data), "-R", "-X", "stream", "-c", "fast", "--no-sync",
        )
        standby.configure(standby.own_settings() + f"cluster_name = '{STANDBY_NAME}'\n")
        standby.pg_ctl("start")
        self.wait_streaming()
        if self.synchronous:
            primary.query(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'")
            primary.query("ALTER SYSTEM SET synchronous_commit = 'on'")
            primary.query("SELECT pg_reload_conf()")
            wait_until(lambda: self.replication_state() == ("streaming", "sync"), 30,
                       "the standby to become synchronous", every=0.05)

    def replication_state(self) -> tuple[str, str] | None:
        """(state, sync_state) of the standby as the primary sees it; None if absent."""
        found = self.primary.query(
            "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = %s",
            [STANDBY_NAME],
        )
        return (found[0][0], found[0][1]) if found else None

    def wait_streaming(self) -> None:
        wait_until(lambda: (self.replication_state() or ("",))[0] == "streaming", 60,
                   "the standby to stream from the primary", every=0.05)

    def lag(self) -> int:
        """Bytes of WAL the primary has written that the standby has not replayed."""
        assert self.standby is not None
        written = self.primary.query("SELECT pg_current_wal_lsn()::text")[0][0]
        replayed = self.standby.query("SELECT pg_last_wal_replay_lsn()::text",
                                      local=True)[0][0]
        return int(self.primary.query("SELECT pg_wal_lsn_diff(%s, %s)",
                                      [written, replayed])[0][0])

    def cut_replication(self) -> None:
        """Stop the standby's WAL receiver (``primary_conninfo = ''``, reloaded): what the
        primary commits from now on never reaches the standby. The deterministic form of
        the last commits that have not reached the standby when its primary dies
        (replication lag). Asynchronous: the primary goes on acknowledging commits;
        synchronous: every COMMIT waits for the standby, which never answers."""
        assert self.standby is not None
        standby = self.standby
        self._conninfo = standby.query("SHOW primary_conninfo", local=True)[0][0]
        standby.query("ALTER SYSTEM SET primary_conninfo = ''", local=True)
        standby.query("SELECT pg_reload_conf()", local=True)
        wait_until(lambda: not standby.query("SELECT 1 FROM pg_stat_wal_receiver", local=True), 30,
                   "the standby's WAL receiver to stop", every=0.05)
        wait_until(lambda: self.replication_state() is None, 30,
                   "the primary to lose its standby", every=0.05)

    def resume_replication(self) -> None:
        """Undo :meth:`cut_replication`: the standby streams again (and is synchronous
        again where it was), so commits waiting for it go through."""
        assert self.standby is not None and self._conninfo
        standby = self.standby
        standby.query(f"ALTER SYSTEM SET primary_conninfo = {_literal(self._conninfo)}",
                      local=True)
        standby.query("SELECT pg_reload_conf()", local=True)
        self.wait_streaming()
        if self.synchronous:
            wait_until(lambda: self.replication_state() == ("streaming", "sync"), 60,
                       "the standby to become synchronous again", every=0.05)

    def promote(self) -> None:
        """``pg_ctl promote``, waiting until the standby takes writes."""
        assert self.standby is not None
        standby = self.standby
        standby.pg_ctl("promote")
        wait_until(
            lambda: standby.query("SELECT NOT pg_is_in_recovery()", local=True)[0][0],
            60, "the standby to leave recovery", every=0.05,
        )

    def env(self) -> dict[str, str]:
        """A Django process's environment: both servers in one host list, the session
        read-write, so it always lands on the primary of the moment."""
        assert self.standby is not None
        return django_env(
            self.primary.url(),
            HOST="127.0.0.1,127.0.0.1",
            PORT=f"{self.primary.port},{self.standby.port}",
            OPTIONS={"target_session_attrs": "read-write", "connect_timeout": 5},
        )

    def close(self) -> None:
        for server in (self.standby, self.primary):
            if server is not None:
                server.stop()


def _literal(text: str) -> str:
    """``text`` as an SQL string literal (ALTER SYSTEM takes no parameters)."""
    return "'" + text.replace("'", "''") + "'"


def now_us() -> int:
    """This host's wall clock in epoch µs: the clock both private servers read too."""
    return time.time_ns() // 1000
