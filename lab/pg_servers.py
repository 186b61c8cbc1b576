"""Throw-away PostgreSQL clusters on this machine: one server, or a primary and a standby.

Never the shared server: ``initdb`` into a temporary folder, on a free port on 127.0.0.1
only (and a Unix socket in that folder), run as the ``postgres`` OS user when run as root,
because initdb refuses root. :class:`Server` is one cluster; :class:`Replicated` is a primary
with a streaming standby made by ``pg_basebackup -R``. Whoever creates one calls its
``close()``/``stop()`` in a ``finally``: the servers are stopped by ``pg_ctl`` (by the
postmaster's PID if that fails) and their folders removed, also after a failure.

Here, in the lab, because the lab's PostgreSQL failover scenarios (lab/scenarios.py) run on
the same pair as the failover tests, and the lab imports nothing from tests/: the tests'
tests/support/pg_clusters.py adds to these classes what needs the tests' Django settings.
A machine without what this needs (server binaries, a ``postgres`` user when root) raises
:class:`~lab.servers.Unavailable`, with what is missing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.django_setup import migrate_in_child
from lab.servers import Unavailable, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
DATABASE = "distlock"
# The standby's application_name on the primary (its cluster_name: pg_basebackup -R writes
# no application_name into primary_conninfo, so the walreceiver uses cluster_name).
STANDBY_NAME = "distlock_standby"


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
                    wait_until(lambda: not alive(pid), 30, f"postmaster {pid} to exit")
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- talking to it -----------------------------------------------------------------------

    def migrate(self) -> None:
        """distlock's tables and the lab's, in a lab worker process (lab/worker.py)."""
        migrate_in_child(self.url())

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
            rows: list[dict[str, Any]] = cursor.fetchall()
            return rows

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
                wait_until(lambda pid=pid: not alive(pid), 30, f"postmaster {pid} to exit")
        shutil.rmtree(folder, ignore_errors=True)


def alive(pid: int) -> bool:
    """Is process ``pid`` still there (signal 0)?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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

    server_class: type[Server] = Server

    def __init__(self, *, synchronous: bool) -> None:
        self.synchronous = synchronous
        self.primary = self.server_class(
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
        self.standby = self.server_class(label="standby")
        self.clone()
        if self.synchronous:
            primary.query(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'")
            primary.query("ALTER SYSTEM SET synchronous_commit = 'on'")
            primary.query("SELECT pg_reload_conf()")
            wait_until(lambda: self.replication_state() == ("streaming", "sync"), 30,
                       "the standby to become synchronous", every=0.05)

    def clone(self) -> None:
        """The standby (not started yet) cloned from the primary, started, streaming."""
        primary, standby = self.primary, self.standby
        assert standby is not None
        primary.command(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
            "-D", str(standby.data), "-R", "-X", "stream", "-c", "fast", "--no-sync",
        )
        standby.configure(standby.own_settings() + f"cluster_name = '{STANDBY_NAME}'\n")
        standby.pg_ctl("start")
        self.wait_streaming()

    def replace_primary(self) -> None:
        """After the primary's crash and :meth:`promote`: the promoted standby is the
        primary, and a new standby cloned from it takes the old primary's port, so a
        client's host list (:meth:`url`) names the pair still. Cheaper than a new pair: one
        ``pg_basebackup``, no ``initdb`` and no migration (the lab's failover trials)."""
        assert self.standby is not None
        port = self.primary.port
        self.primary.stop()
        self.primary = self.standby
        self.standby = self.server_class(label="standby")
        self.standby.port = port
        self.clone()

    def url(self) -> str:
        """libpq's URL for both servers, the session read-write: whichever is the primary
        of the moment answers (the lab's clients; lab.django_setup.database reads it)."""
        assert self.standby is not None
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
        return (f"postgresql://postgres@{hosts}/{DATABASE}"
                "?target_session_attrs=read-write&connect_timeout=5")

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
