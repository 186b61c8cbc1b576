"""A highly available PostgreSQL on this machine: three etcd members and Patroni managing
three PostgreSQL 15 members, all on loopback ports.

etcd is :class:`lab.servers.EtcdCluster` (Debian ``etcd-server``); Patroni is Debian's
``patroni`` (3.0.x), one process per member, run as the ``postgres`` OS user when we are
root (initdb refuses root), each with its own data folder, PostgreSQL port and REST API
port. Everything is stopped by PID by :meth:`Patroni.stop`, also after a failure:
Patroni first (SIGTERM: it stops its PostgreSQL), then any postmaster left (by the PID in
its ``postmaster.pid``), then etcd, and the folder is removed.

Django reaches the leader of the moment through libpq's host list with
``target_session_attrs=read-write`` (:meth:`Patroni.env`), as docs/deployment.md
describes. The settings are those docs/deployment.md gives as the tested configuration:
``ttl`` 20 s, ``loop_wait`` 2 s, ``retry_timeout`` 5 s, asynchronous replication,
``maximum_lag_on_failover`` large (a standby that missed the last commits is promoted:
the case the timeline follow is for). :meth:`Patroni.set_synchronous` turns Patroni's
``synchronous_mode`` on or off in the running cluster (its dynamic configuration, PATCH
/config), with ``synchronous_mode_strict`` off (docs/deployment.md says why).

With ``isolated`` (:class:`Isolation`), member ``pg0`` runs on a "machine" of its own: a
network namespace (lab/netns.py) with two links to this one, ``db`` (its
PostgreSQL, its REST API: clients and standbys reach it there) and ``dcs`` (its only way
to etcd, which also listens on that link's root end). It bootstraps the cluster, so it is
the leader; cutting ``dcs`` partitions the leader from etcd alone, everything else still
reaches it. :meth:`Patroni.restore` does not bring such a cluster back: one per test.

``scripts/ha [-- command]`` starts one and runs a command beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab import netns
from lab.pg_servers import alive
from lab.servers import EtcdCluster, free_port
from tests.support.helpers import wait_until
from tests.support.pg_clusters import DATABASE, Unavailable, _connect, django_env, migrate, pg_bin
from tests.support.watchdog import Watchdog

SCOPE = "distlock"
TTL, LOOP_WAIT, RETRY_TIMEOUT = 20, 2, 5


@dataclass
class Member:
    """One Patroni member: its name, ports, folder and Patroni process."""

    name: str
    port: int
    api_port: int
    dir: Path
    process: subprocess.Popen[bytes] | None = None
    #: Where it listens (PostgreSQL and REST API) and is reached.
    address: str = "127.0.0.1"
    #: The command prefix that runs it on its host (``ip netns exec …``), if not this one.
    prefix: list[str] = field(default_factory=list)

    @property
    def data(self) -> Path:
        return self.dir / "data"

    @property
    def api(self) -> str:
        return f"http://{self.address}:{self.api_port}"

    def status(self) -> dict[str, Any] | None:
        """Patroni's own answer about this member (GET /patroni), None if it is down."""
        try:
            with urllib.request.urlopen(f"{self.api}/patroni", timeout=2) as answer:
                found: dict[str, Any] = json.loads(answer.read())
                return found
        except (OSError, ValueError, urllib.error.HTTPError):
            return None

    def postmaster_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().split()[0])
        return None

    def server_pids(self) -> list[int]:
        """The postmaster and every process it forked (backends, WAL senders …)."""
        main = self.postmaster_pid()
        if main is None or not alive(main):
            return []
        found = [main]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == main:
                        found.append(int(entry.name))
        return found

    def query(self, sql: str, params: list[Any] | None = None,
              dbname: str = DATABASE) -> list[tuple[Any, ...]]:
        with _connect(host=self.address, port=self.port, user="postgres",
                      dbname=dbname) as connection, connection.cursor() as cursor:
            cursor.execute(sql, params or [])
            return cursor.fetchall() if cursor.description else []

    def rows(self, table: str) -> list[dict[str, Any]]:
        """Every row of ``table`` as a dict (the history checker's input)."""
        from psycopg.rows import dict_row

        with _connect(host=self.address, port=self.port, user="postgres", dbname=DATABASE,
                      row_factory=dict_row) as connection:
            return list(connection.execute(f"SELECT * FROM {table}").fetchall())


@dataclass
class Isolation:
    """Member pg0's machine: a namespace reached over ``db`` (PostgreSQL, REST API) and
    reaching etcd over ``dcs`` only, so that either can be cut alone."""

    db: netns.Host = field(default_factory=lambda: netns.Host("hadb"))
    dcs: netns.Host = field(init=False)

    def __post_init__(self) -> None:
        self.dcs = netns.Host("hadcs", joins=self.db)

    def create(self) -> None:
        netns.check()
        # What killed runs left (only theirs: the names are per run, and a live run's,
        # a partition test's beside this one, stay).
        netns.remove_leftovers()
        self.db.create()
        self.dcs.create()

    def remove(self) -> None:
        self.dcs.remove()
        self.db.remove()


@dataclass
class Patroni:
    """etcd (3 members) and Patroni (``size`` PostgreSQL members); a context manager."""

    size: int = 3
    etcd: EtcdCluster = field(default_factory=EtcdCluster)
    members: list[Member] = field(default_factory=list)
    dir: Path | None = None
    isolated: Isolation | None = None
    #: Patroni's watchdog, ``mode: required``, on an emulated device per member
    #: (tests/support/watchdog.py): ``safety_margin`` seconds before the leader key's ttl.
    watchdog_margin: int | None = None
    watchdogs: dict[str, Watchdog] = field(default_factory=dict)

    def __enter__(self) -> Patroni:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- life cycle --------------------------------------------------------------------

    def start(self) -> None:
        """etcd up, the members started, a leader elected with the others streaming
        from it, database ``distlock`` created and migrated."""
        if shutil.which("patroni") is None:
            raise Unavailable("patroni not found (Debian package patroni)")
        self.bin = pg_bin()
        self.account = _account()
        self.dir = Path(tempfile.mkdtemp(prefix="distlock-patroni-"))
        os.chmod(self.dir, 0o755)
        try:
            if self.isolated is not None:
                self.isolated.create()
                self.etcd.also_listen = [self.isolated.dcs.gateway]
            self.etcd.start()
            self.members = [
                Member(f"pg{i}", free_port(), free_port(), self.dir / f"pg{i}")
                for i in range(self.size)
            ]
            if self.isolated is not None:
                self.members[0].address = self.isolated.db.address
                self.members[0].prefix = self.isolated.db.prefix()
            for member in self.members:
                member.dir.mkdir()
                if self.account is not None:
                    os.chown(member.dir, self.account.pw_uid, self.account.pw_gid)
                self._configure(member)
                if self.watchdog_margin is not None:
                    self.watchdogs[member.name] = watchdog = Watchdog(
                        member.dir / "watchdog", lambda member=member: self.reset(member))
                    watchdog.start(None if self.account is None
                                   else (self.account.pw_uid, self.account.pw_gid))
            if self.isolated is not None:
                # The isolated member bootstraps (initdb) alone: it is the leader.
                self.start_member(0)
                self.wait_leader(120)
            # All at once: one wins the bootstrap (initdb) in etcd, the others clone it.
            for index in range(self.size):
                if self.members[index].process is None:
                    self.start_member(index)
            leader = self.wait_leader(120)
            leader.query(f"CREATE DATABASE {DATABASE}", dbname="postgres")
            migrate(self.env())
            self.wait_streaming(self.size - 1, 120)
        except BaseException:
            self.stop()
            raise

    def _configure(self, member: Member) -> None:
        hosts = ",".join(self.etcd.endpoints)
        etcd: dict[str, Any] = {"hosts": hosts}
        if member.prefix and self.isolated is not None:
            # etcd's root end of the dcs link; no discovery of the members' advertised
            # (loopback) addresses, which this host cannot reach.
            etcd = {"hosts": ",".join(f"{self.isolated.dcs.gateway}:{m.client_port}"
                                      for m in self.etcd.members), "use_proxies": True}
        hba = ["local all all trust", "host all all 127.0.0.1/32 trust",
               "host replication all 127.0.0.1/32 trust",
               f"host all all {netns.NETWORK} trust",
               f"host replication all {netns.NETWORK} trust"]
        config = {
            "scope": SCOPE,
            "namespace": f"/distlock-{os.getpid()}-{id(self)}/",
            "name": member.name,
            "log": {"level": "INFO", "dir": str(member.dir)},
            "restapi": {"listen": f"{member.address}:{member.api_port}",
                        "connect_address": f"{member.address}:{member.api_port}"},
            "etcd3": etcd,
            "bootstrap": {
                "dcs": {
                    "ttl": TTL, "loop_wait": LOOP_WAIT, "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 1 << 30,
                    "postgresql": {"use_pg_rewind": False, "parameters": {
                        "wal_level": "replica", "max_wal_senders": 8,
                        "max_replication_slots": 8, "wal_keep_size": "64MB",
                        "hot_standby": "on",
                    }},
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
                "pg_hba": hba,
            },
            "postgresql": {
                "listen": f"{member.address}:{member.port}",
                "connect_address": f"{member.address}:{member.port}",
                "data_dir": str(member.data),
                "bin_dir": str(self.bin),
                "pgpass": str(member.dir / "pgpass"),
                # Not the default spread checkpoint: a clone would wait minutes for it.
                "basebackup": [{"checkpoint": "fast"}],
                "authentication": {"superuser": {"username": "postgres"},
                                   "replication": {"username": "postgres"}},
                "parameters": {
                    "unix_socket_directories": str(member.dir),
                    # A crash here is a process dying, never the machine.
                    "fsync": "off", "max_connections": 60, "shared_buffers": "16MB",
                },
                "pg_hba": hba,
            },
            "tags": {"nofailover": False, "noloadbalance": False},
        }
        if self.watchdog_margin is not None:
            config["watchdog"] = {"mode": "required", "driver": "testing",
                                  "device": str(member.dir / "watchdog"),
                                  "safety_margin": self.watchdog_margin}
        path = member.dir / "patroni.yml"
        path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        if self.account is not None:
            os.chown(path, self.account.pw_uid, self.account.pw_gid)

    def start_member(self, index: int) -> None:
        member = self.members[index]
        log = (member.dir / "patroni.out").open("ab")
        user: dict[str, Any] = {}
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"}
        command = ["patroni", str(member.dir / "patroni.yml")]
        if self.account is not None:
            user = {"user": self.account.pw_uid, "group": self.account.pw_gid,
                    "extra_groups": []}
            env["HOME"] = self.account.pw_dir
        if member.prefix:
            # Entering the namespace needs root: the user changes after it (each program
            # execs the next, so the PID is Patroni's).
            assert self.account is not None, "network namespaces need root"
            command = [*member.prefix, "setpriv", f"--reuid={self.account.pw_uid}",
                       f"--regid={self.account.pw_gid}", "--clear-groups", *command]
            user = {}
        # Its own session: a Ctrl-C of the test run does not reach it before stop() does.
        member.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, env=env, cwd=member.dir, **user,
        )
        log.close()

    def restore(self, timeout: float = 120) -> None:
        """After a fault: every etcd member running, every Patroni member running (one
        that was killed comes back as a fresh clone of the leader: its data, which may
        have diverged, is removed) and streaming from the leader."""
        for index, etcd_member in enumerate(self.etcd.members):
            if etcd_member.process is None:
                self.etcd.start_again(index)
        for index, member in enumerate(self.members):
            if member.process is None:
                self.kill_server(member)
                shutil.rmtree(member.data, ignore_errors=True)
                self.start_member(index)
        self.wait_leader(timeout)
        self.wait_streaming(self.size - 1, timeout)
        wait_until(lambda: len(self.replicas()) == self.size - 1, timeout,
                   "Patroni to list every replica as running", every=0.2)

    def kill_server(self, member: Member, sig: int = signal.SIGKILL) -> None:
        """Signal every process of ``member``'s PostgreSQL (SIGKILL: a crash)."""
        for pid in member.server_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def reset(self, member: Member) -> None:
        """What a watchdog's reset does to ``member``'s machine: SIGKILL its Patroni and
        every process of its PostgreSQL at once (stopped ones too), nothing shut down."""
        self.signal_member(member, signal.SIGKILL)

    def pids(self, member: Member) -> list[int]:
        """``member``'s Patroni and every process of its PostgreSQL: its "machine"."""
        return ([] if member.process is None else [member.process.pid]) + member.server_pids()

    def signal_member(self, member: Member, sig: int) -> None:
        """Signal ``member``'s whole machine (SIGSTOP: it stalls; SIGCONT: it resumes)."""
        for pid in self.pids(member):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def freeze(self, member: Member, timeout: float = 10) -> None:
        """SIGSTOP ``member``'s whole machine until every process of it is stopped: the
        postmaster may fork a backend just before it stops, which one pass would miss."""
        def frozen() -> bool:
            self.signal_member(member, signal.SIGSTOP)
            return all(_state(pid) in ("T", "t", "Z", None) for pid in self.pids(member))

        wait_until(frozen, timeout, f"every process of {member.name} stopped", every=0.01)

    def stop(self) -> None:
        for watchdog in self.watchdogs.values():
            watchdog.stop()
        self.watchdogs = {}
        for member in self.members:
            self.kill_member(member, signal.SIGKILL)
        for member in self.members:
            for pid in member.server_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            main = member.postmaster_pid()
            if main is not None and alive(main):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(main, signal.SIGQUIT)
                with contextlib.suppress(TimeoutError):
                    wait_until(lambda main=main: not alive(main), 30, f"postmaster {main}")
        self.etcd.stop()
        if self.isolated is not None:
            self.isolated.remove()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def kill_member(self, member: Member, sig: int = signal.SIGKILL, wait: float = 30) -> None:
        """Signal Patroni of ``member`` (SIGKILL: a crash) and wait for it to exit."""
        process = member.process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait(timeout=30)
        member.process = None

    # -- the cluster's state -----------------------------------------------------------

    def cluster(self) -> dict[str, Any] | None:
        """GET /cluster from any member that answers (an isolated one last: cut from etcd,
        it answers with what it saw last)."""
        for member in sorted(self.members, key=lambda m: bool(m.prefix)):
            if member.process is None:
                continue
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(f"{member.api}/cluster", timeout=2) as answer,
            ):
                found: dict[str, Any] = json.loads(answer.read())
                return found
        return None

    def leader(self) -> Member | None:
        """The member Patroni calls leader, if it runs as a primary."""
        found = self.cluster()
        for entry in (found or {}).get("members", []):
            if entry.get("role") == "leader" and entry.get("state") == "running":
                for member in self.members:
                    if member.name == entry["name"] and member.process is not None:
                        return member
        return None

    def wait_leader(self, timeout: float, other_than: Member | None = None) -> Member:
        found: list[Member] = []

        def elected() -> bool:
            leader = self.leader()
            if leader is None or leader is other_than:
                return False
            try:
                writable = not leader.query("SELECT pg_is_in_recovery()", dbname="postgres")[0][0]
            except Exception:  # noqa: BLE001 - not up yet
                return False
            if writable:
                found.append(leader)
            return writable

        wait_until(elected, timeout, "a Patroni leader taking writes", every=0.2)
        return found[-1]

    def wait_streaming(self, replicas: int, timeout: float) -> None:
        """Until the leader has ``replicas`` standbys streaming from it."""
        def streaming() -> bool:
            leader = self.leader()
            if leader is None:
                return False
            try:
                rows = leader.query(
                    "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'",
                    dbname="postgres",
                )
            except Exception:  # noqa: BLE001 - not up yet
                return False
            return int(rows[0][0]) >= replicas

        wait_until(streaming, timeout, f"{replicas} standbys streaming", every=0.2)

    def replicas(self) -> list[Member]:
        """The members /cluster lists as running replicas (switchover candidates)."""
        found = self.cluster() or {}
        running = {
            entry["name"] for entry in found.get("members", [])
            # Patroni lists a synchronous standby as sync_standby (synchronous_mode).
            if entry.get("role") in ("replica", "sync_standby")
            and entry.get("state") in ("running", "streaming")
        }
        return [m for m in self.members if m.name in running and m.process is not None]

    def switchover(self, leader: Member, timeout: float = 60) -> Member:
        """A switchover through Patroni's REST API (what ``patronictl switchover`` does) to
        a running replica; returns the candidate. Patroni answers 412 while it does not
        count the candidate as a healthy member yet (just after a member came back): asked
        again until the deadline."""
        done: list[Member] = []

        def switched() -> bool:
            candidates = self.replicas()
            if not candidates:
                return False
            body = json.dumps({"leader": leader.name, "candidate": candidates[0].name})
            request = urllib.request.Request(
                f"{leader.api}/switchover", data=body.encode(), method="POST",
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    assert answer.status == 200, answer.read()
            except urllib.error.HTTPError as refused:
                if refused.code != 412:
                    raise
                return False
            done.append(candidates[0])
            return True

        wait_until(switched, timeout, "Patroni to accept the switchover", every=0.5)
        return done[0]

    def set_synchronous(self, on: bool, timeout: float = 60) -> None:
        """Patroni's ``synchronous_mode`` on or off, through its dynamic configuration (what
        ``patronictl edit-config`` writes), and wait until the leader has it in force: one
        standby named in ``synchronous_standby_names`` and streaming as ``sync``, or none.

        ``synchronous_mode_strict`` stays off: with no synchronous standby left Patroni lets
        the leader commit alone rather than stop every write, and a standby that was not
        synchronous is still never promoted automatically (Patroni's rule for
        ``synchronous_mode``); distlock's timeline follow covers the commits lost then."""
        leader = self.wait_leader(timeout)
        body = json.dumps({"synchronous_mode": on, "synchronous_mode_strict": False})
        request = urllib.request.Request(
            f"{leader.api}/config", data=body.encode(), method="PATCH",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200, answer.read()
        self.wait_synchronous(on, timeout)

    def wait_synchronous(self, on: bool, timeout: float = 60) -> None:
        """Until the leader runs as ``synchronous_mode`` says: with it on, a standby
        streaming as ``sync`` and named so in etcd (Patroni lists it as sync_standby; with
        none named, Patroni promotes nobody when the leader dies); with it off, none."""
        def in_force() -> bool:
            current = self.leader()
            if current is None:
                return False
            try:
                names = current.query("SHOW synchronous_standby_names", dbname="postgres")
                synced = current.query(
                    "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync' "
                    "AND state = 'streaming'", dbname="postgres",
                )
            except Exception:  # noqa: BLE001 - a restart of the leader's session
                return False
            if not on:
                return not names[0][0]
            named = any(entry.get("role") == "sync_standby"
                        for entry in (self.cluster() or {}).get("members", []))
            return bool(names[0][0]) and int(synced[0][0]) == 1 and named

        wait_until(in_force, timeout,
                   f"Patroni's synchronous_mode {'on' if on else 'off'} in force", every=0.2)

    def synchronous(self) -> bool:
        """Whether the dynamic configuration has ``synchronous_mode`` on."""
        leader = self.wait_leader(30)
        with urllib.request.urlopen(f"{leader.api}/config", timeout=5) as answer:
            return bool(json.loads(answer.read()).get("synchronous_mode"))

    # -- clients -----------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """A Django process's environment: every member in one libpq host list, the
        session read-write, so it lands on the leader of the moment."""
        return django_env(
            f"postgresql://postgres@127.0.0.1:{self.members[0].port}/{DATABASE}",
            HOST=",".join(member.address for member in self.members),
            PORT=",".join(str(member.port) for member in self.members),
            OPTIONS={"target_session_attrs": "read-write", "connect_timeout": 3},
        )


def _state(pid: int) -> str | None:
    """A process's state letter (``T``: stopped), None if it is gone."""
    with contextlib.suppress(OSError, IndexError):
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    return None


def _account() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        raise Unavailable("running as root and there is no postgres user") from None
