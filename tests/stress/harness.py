"""The stress harness: spawned workers, a seeded nemesis, ground truth, the checker.

One run (anchors-reliability.md §5):

1. prepare: empty the stress tables, install the triggers that log every change of the
   lock table into ``stressapp_lockhistory`` (in the changing transaction), create one
   Resource per lock;
2. fault phase: N worker processes (tests/support/stress_workers.py) loop acquire → read → hold →
   fenced write → release on K locks, while the nemesis, every U(1.5, 3) s, picks one
   of: SIGSTOP a worker for 2 × ttl then SIGCONT, SIGKILL a worker and start a new one,
   terminate a worker's PostgreSQL backend, break a lock with ``distlock.break_lock``,
   or nothing. On PostgreSQL and MariaDB two workers run under ``faketime`` ±30 s
   (wall clock only). Every choice comes from the seed and is logged;
3. heal: continue everyone, stop the workers, then time a fresh acquire of every lock;
4. check (tests/stress/checker.py) and, if anything is wrong, keep the histories, the
   nemesis log and CSV dumps of the tables under ``artifacts/``.

Usable from pytest (tests/test_history.py) and from the command line (``python -m
tests.stress``), always on a test database, never on a real one.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from django.db import connections

from distlock import acquire, break_lock
from distlock.constants import LOCK_TABLE as TABLE
from distlock.db import db_now_us
from tests.stress.checker import Report, Volume, check
from tests.support.processes import LIBFAKETIME, ROOT, skewed_clock_env

ARTIFACTS = ROOT / "artifacts"
HISTORY = "stressapp_lockhistory"
TABLES = (TABLE, HISTORY, "stressapp_write", "stressapp_resource")


@dataclass
class Profile:
    """How big and how hostile a run is."""

    workers: int = 6
    locks: int = 2
    ttl: float = 1.0
    fault_seconds: float = 30.0
    nemesis_every: tuple[float, float] = (1.5, 3.0)
    # Weights of: pause, kill, terminate backend, break, nothing.
    nemesis_weights: tuple[int, int, int, int, int] = (40, 15, 20, 10, 15)
    skewed_clocks: bool = True
    fencing: bool = True
    weak_clock: bool = False
    volume: Volume = field(default_factory=Volume)
    # A fresh acquire after healing must succeed within ttl + this many seconds.
    live_margin: float = 5.0
    prefix: str = "stress"

    def names(self) -> list[str]:
        return [f"{self.prefix}:{index}" for index in range(self.locks)]

    def control(self) -> str | None:
        """What a control run (a self-test with a safety turned off) must show, or None.

        Its violations are the point: they prove the checker sees what it is meant to
        catch. Said in its output, so nobody reads them as a failure of distlock.
        """
        if not self.fencing:
            return ("fencing is OFF, so stale holders' writes go through: the checker must "
                    "report violations (c)/(d)")
        if self.weak_clock:
            return ("the acquire uses a WEAK clock (read when the call began), so leases "
                    "overlap: the checker must report violations (a)")
        return None


@dataclass
class Outcome:
    seed: int
    profile: Profile
    report: Report
    vendor: str
    seconds: float
    nemesis: list[dict[str, Any]]
    artifacts: Path | None = None

    def line(self) -> str:
        actions: dict[str, int] = {}
        for event in self.nemesis:
            actions[event["action"]] = actions.get(event["action"], 0) + 1
        faults = " ".join(f"{key}={value}" for key, value in sorted(actions.items()))
        control = " CONTROL RUN (violations expected)" if self.profile.control() else ""
        return (
            f"distlock stress{control} [{self.vendor}] seed={self.seed} "
            f"workers={self.profile.workers} "
            f"locks={self.profile.locks} ttl={self.profile.ttl}s "
            f"fencing={'on' if self.profile.fencing else 'OFF'} "
            f"clock={'WEAK' if self.profile.weak_clock else 'db-real-time'} "
            f"{self.seconds:.0f}s: {self.report.summary()} | nemesis: {faults or 'none'}"
        )

    def verdict(self) -> str:
        """One line: did the run show what it is meant to?

        A normal run must have no violation; a control run (:meth:`Profile.control`) must
        have some — violations there are expected, and none means the checker is blind.
        """
        control = self.profile.control()
        found = len(self.report.violations)
        if control is None:
            return "no violations" if found == 0 else f"{found} VIOLATIONS"
        if found:
            return (f"control run: {found} violations EXPECTED and found ({control}); "
                    "the checker works")
        return f"control run: NO violations found, but {control}: the checker missed them"


# -- ground truth in the database ----------------------------------------------------------

_COLUMNS = f"INSERT INTO {HISTORY} (name, kind, token, owner, at_us, expires_us) VALUES "
_GRANT = _COLUMNS + "(NEW.name, 'grant', NEW.token, NEW.owner, NEW.acquired_us, NEW.expires_us)"
_END = _COLUMNS + "(NEW.name, 'end', OLD.token, OLD.owner, NEW.expires_us, OLD.expires_us)"
_RENEW = _COLUMNS + "(NEW.name, 'renew', NEW.token, NEW.owner, NEW.renewed_us, NEW.expires_us)"
# A token change that leaves the row free is no grant: it is distlock_failover raising the
# tokens, which ends the lease the row had (if any).
_IS_GRANT = "NEW.token <> OLD.token AND NEW.owner <> ''"
_IS_END = "OLD.owner <> '' AND NEW.owner = ''"
_IS_RENEW = "NEW.token = OLD.token AND NEW.owner <> '' AND NEW.expires_us <> OLD.expires_us"

_TRIGGERS = {
    "postgresql": [
        f"""CREATE OR REPLACE FUNCTION stressapp_log_lock() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                IF TG_OP = 'INSERT' OR {_IS_GRANT} THEN {_GRANT};
                ELSIF {_IS_END} THEN {_END};
                ELSIF {_IS_RENEW} THEN {_RENEW};
                END IF;
                RETURN NULL;
            END $$""",
        f"""CREATE TRIGGER stressapp_log_lock AFTER INSERT OR UPDATE ON {TABLE}
            FOR EACH ROW EXECUTE FUNCTION stressapp_log_lock()""",
    ],
    "sqlite": [
        f"CREATE TRIGGER stressapp_lock_insert AFTER INSERT ON {TABLE} BEGIN {_GRANT}; END",
        f"CREATE TRIGGER stressapp_lock_grant AFTER UPDATE ON {TABLE} WHEN {_IS_GRANT} "
        f"BEGIN {_GRANT}; END",
        f"CREATE TRIGGER stressapp_lock_end AFTER UPDATE ON {TABLE} WHEN {_IS_END} "
        f"BEGIN {_END}; END",
        f"CREATE TRIGGER stressapp_lock_renew AFTER UPDATE ON {TABLE} WHEN {_IS_RENEW} "
        f"BEGIN {_RENEW}; END",
    ],
    "mysql": [
        f"CREATE TRIGGER stressapp_lock_insert AFTER INSERT ON {TABLE} FOR EACH ROW {_GRANT}",
        f"""CREATE TRIGGER stressapp_lock_update AFTER UPDATE ON {TABLE} FOR EACH ROW
            BEGIN
                IF {_IS_GRANT} THEN {_GRANT};
                ELSEIF {_IS_END} THEN {_END};
                ELSEIF {_IS_RENEW} THEN {_RENEW};
                END IF;
            END""",
    ],
}
_DROP = {
    "postgresql": [
        f"DROP TRIGGER IF EXISTS stressapp_log_lock ON {TABLE}",
        "DROP FUNCTION IF EXISTS stressapp_log_lock()",
    ],
    "sqlite": [
        f"DROP TRIGGER IF EXISTS stressapp_lock_{kind}"
        for kind in ("insert", "grant", "end", "renew")
    ],
    "mysql": [
        "DROP TRIGGER IF EXISTS stressapp_lock_insert",
        "DROP TRIGGER IF EXISTS stressapp_lock_update",
    ],
}


def trigger_statements(vendor: str) -> list[str]:
    """The statements that (re)install the history triggers on a ``vendor`` database."""
    return _DROP[vendor] + _TRIGGERS[vendor]


def install_triggers(alias: str = "default") -> None:
    connection = connections[alias]
    with connection.cursor() as cursor:
        for statement in trigger_statements(connection.vendor):
            cursor.execute(statement)


def drop_triggers(alias: str = "default") -> None:
    connection = connections[alias]
    with connection.cursor() as cursor:
        for statement in _DROP[connection.vendor]:
            cursor.execute(statement)


def rows(table: str, alias: str = "default") -> list[dict[str, Any]]:
    with connections[alias].cursor() as cursor:
        cursor.execute(f"SELECT * FROM {table}")
        columns = [column[0] for column in cursor.description]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]


def prepare(profile: Profile, alias: str = "default") -> None:
    from tests.stressapp.models import LockHistory, Resource, Write

    names = profile.names()
    with connections[alias].cursor() as cursor:
        cursor.execute(f"DELETE FROM {TABLE} WHERE name LIKE %s", [f"{profile.prefix}:%"])
    LockHistory.objects.using(alias).all().delete()
    Write.objects.using(alias).all().delete()
    Resource.objects.using(alias).all().delete()
    install_triggers(alias)
    Resource.objects.using(alias).bulk_create(Resource(name=name) for name in names)
    for name in names:  # create the lock rows, so the workers all meet existing rows
        lease = acquire(name, ttl=60, timeout=30, using=alias)
        assert lease is not None
        lease.release()


# -- worker processes ----------------------------------------------------------------------


class Workers:
    """The worker processes of a run, each writing its history to its own file."""

    def __init__(
        self, profile: Profile, seed: int, directory: Path, vendor: str,
        env: dict[str, str] | None = None, pause_after_error: float = 0.0,
    ) -> None:
        """``env``: variables that replace the workers' own (another database server);
        ``pause_after_error``: how long a worker waits after a failed call before its
        next one, as a real client backs off while its server is down."""
        self.profile = profile
        self.env = env or {}
        self.pause_after_error = pause_after_error
        self.directory = directory
        self.stop_path = directory / "stop"
        self.rng = random.Random(seed)
        self.vendor = vendor
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.ids: dict[int, str] = {}
        self.generation: dict[int, int] = {}
        self.files: list[Any] = []

    def skew(self, slot: int) -> str | None:
        # SQLite reads the clock of each process's own host: faking it would fake the
        # "database clock" too, which SQLite cannot have separately (see README).
        if not self.profile.skewed_clocks or self.vendor == "sqlite" or slot > 1:
            return None
        if LIBFAKETIME is None:
            return None
        return "+30s" if slot == 0 else "-30s"

    def start(self, slot: int) -> None:
        generation = self.generation.get(slot, -1) + 1
        self.generation[slot] = generation
        worker = f"w{slot}.{generation}"
        args = [
            worker, self.profile.names(), self.profile.ttl, self.rng.randrange(2**32),
            str(self.stop_path), self.profile.fencing, self.profile.weak_clock,
            self.profile.fault_seconds + 120, self.pause_after_error,
        ]
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DISTLOCK_TEST_CHILD_DB": str(connections["default"].settings_dict["NAME"]),
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        skew = self.skew(slot)
        if skew:
            env.update(skewed_clock_env(skew))
        out = open(self.directory / f"history-{worker}.jsonl", "wb")  # noqa: SIM115
        err = open(self.directory / f"stderr-{worker}.txt", "wb")  # noqa: SIM115
        self.files += [out, err]
        self.procs[slot] = subprocess.Popen(
            [sys.executable, "-m", "tests.support.worker", "tests.support.stress_workers:run",
             json.dumps(args)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=ROOT,
            start_new_session=True,
        )
        self.ids[slot] = worker

    def signal(self, slot: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[slot].pid, sig)

    def alive(self) -> list[int]:
        return [slot for slot, proc in self.procs.items() if proc.poll() is None]

    def stop(self, grace: float) -> None:
        """Continue everyone, ask them to stop, wait; kill what is left after ``grace``."""
        for slot in self.alive():
            self.signal(slot, signal.SIGCONT)
        self.stop_path.touch()
        deadline = time.monotonic() + grace
        for slot, proc in self.procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.signal(slot, signal.SIGKILL)
                proc.wait(timeout=10)
        for handle in self.files:
            handle.close()

    def kill_all(self) -> None:
        for slot in self.alive():
            self.signal(slot, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for handle in self.files:
            with contextlib.suppress(OSError):
                handle.close()


def read_histories(directory: Path) -> list[dict[str, Any]]:
    """Every complete line of every worker's history (a killed worker may leave half a line)."""
    events = []
    for path in sorted(directory.glob("history-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    events.append(event)
    return events


# -- the nemesis ---------------------------------------------------------------------------

ACTIONS = ("pause", "kill", "terminate", "break", "nothing")


class Nemesis(threading.Thread):
    """Seeded faults during the fault phase; each one logged with the database time."""

    def __init__(self, profile: Profile, workers: Workers, seed: int, until: float) -> None:
        super().__init__(name="nemesis", daemon=True)
        self.profile = profile
        self.workers = workers
        self.rng = random.Random(seed ^ 0x5EED)
        self.until = until
        self.log: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.halt = threading.Event()

    def note(self, action: str, **data: Any) -> None:
        self.log.append({"action": action, "db_us": db_now_us("default"), **data})

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported by the harness
            self.error = exc
        finally:
            connections.close_all()

    def _run(self) -> None:
        vendor = connections["default"].vendor
        weights = list(self.profile.nemesis_weights)
        if vendor != "postgresql":
            weights[2] = 0  # backend termination by application_name: PostgreSQL only
        while not self.halt.wait(self.rng.uniform(*self.profile.nemesis_every)):
            if time.monotonic() >= self.until:
                return
            action = self.rng.choices(ACTIONS, weights=weights)[0]
            slots = sorted(self.workers.procs)
            slot = self.rng.choice(slots)
            worker = self.workers.ids[slot]
            if action == "pause":
                self.workers.signal(slot, signal.SIGSTOP)
                self.note("pause", worker=worker)
                self.halt.wait(2 * self.profile.ttl)
                self.workers.signal(slot, signal.SIGCONT)
                self.note("continue", worker=worker)
            elif action == "kill":
                self.workers.signal(slot, signal.SIGKILL)
                self.workers.procs[slot].wait(timeout=10)
                self.note("kill", worker=worker)
                self.workers.start(slot)
                self.note("respawn", worker=self.workers.ids[slot])
            elif action == "terminate":
                with connections["default"].cursor() as cursor:
                    cursor.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = %s", [f"distlock-worker-{worker}"],
                    )
                    count = cursor.fetchone()[0]
                self.note("terminate", worker=worker, backends=count)
            elif action == "break":
                name = self.rng.choice(self.profile.names())
                self.note("break", lock=name, broken=break_lock(name, by="stress nemesis"))
            else:
                self.note("nothing")


# -- a run ---------------------------------------------------------------------------------


def liveness(profile: Profile, alias: str = "default") -> dict[str, float | None]:
    """Seconds a fresh acquire of each lock took after healing (None: never got it)."""
    waited: dict[str, float | None] = {}
    limit = profile.ttl + profile.live_margin
    for name in profile.names():
        started = time.monotonic()
        lease = acquire(name, ttl=5, timeout=limit + 5, using=alias)
        waited[name] = None if lease is None else round(time.monotonic() - started, 3)
        if lease is not None:
            lease.release()
    return waited


def check_workers(client: list[dict[str, Any]], workers: Workers, report: Report) -> None:
    """The run itself was sound: no worker crashed, skewed clocks really were skewed."""
    for event in client:
        if event.get("event") == "error":
            report.add("e", f"a worker crashed: {event.get('error')}")
        if event.get("type") == "start":
            slot = int(event["worker"][1:].split(".")[0])
            wanted = workers.skew(slot)
            expected = 0.0 if wanted is None else float(wanted[:-1])
            if abs(event["skew"] - expected) > 5:
                report.add(
                    "e", f"worker {event['worker']}: wall clock {event['skew']} s off the "
                    f"database's, expected {expected} s"
                )


def dump(directory: Path, alias: str = "default") -> None:
    for table in TABLES:
        data = rows(table, alias)
        with open(directory / f"{table}.csv", "w", newline="") as handle:
            if not data:
                continue
            writer = csv.DictWriter(handle, fieldnames=list(data[0]))
            writer.writeheader()
            writer.writerows(data)


def keep(directory: Path, outcome: Outcome) -> Path:
    """Copy a run's files into artifacts/ (gitignored) so the run can be replayed."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = ARTIFACTS / f"stress-{outcome.vendor}-seed{outcome.seed}-{stamp}"
    shutil.copytree(directory, target, dirs_exist_ok=True)
    (target / "report.txt").write_text(
        outcome.line() + "\n\n" + outcome.report.describe(limit=500) + "\n"
    )
    (target / "profile.json").write_text(
        json.dumps({"seed": outcome.seed, **asdict(outcome.profile)}, indent=2, default=str)
    )
    return target


def run(profile: Profile, seed: int, *, keep_on: str = "failure") -> Outcome:
    """One run on the ``default`` database (a test database). ``keep_on``: failure/always/never."""
    vendor = connections["default"].vendor
    directory = Path(tempfile.mkdtemp(prefix="distlock-stress-"))
    prepare(profile)
    workers = Workers(profile, seed, directory, vendor)
    nemesis = None
    started = time.monotonic()
    try:
        for slot in range(profile.workers):
            workers.start(slot)
        until = time.monotonic() + profile.fault_seconds
        nemesis = Nemesis(profile, workers, seed, until)
        nemesis.start()
        while time.monotonic() < until and nemesis.is_alive():
            time.sleep(0.2)
        nemesis.halt.set()
        nemesis.join(timeout=4 * profile.ttl + 30)
        if nemesis.error is not None:
            raise nemesis.error
        # Heal: every worker continues, finishes its current operation and stops.
        workers.stop(grace=3 * profile.ttl + 15)
        waited = liveness(profile)
        client = read_histories(directory)
        report = check(
            lock_history=rows(HISTORY), writes=rows("stressapp_write"),
            resources={row["name"]: row for row in rows("stressapp_resource")},
            client=client, liveness=waited, volume=profile.volume,
            live_within=profile.ttl + profile.live_margin,
        )
        check_workers(client, workers, report)
        (directory / "nemesis.jsonl").write_text(
            "".join(json.dumps(event) + "\n" for event in nemesis.log)
        )
        outcome = Outcome(
            seed, profile, report, vendor, time.monotonic() - started, nemesis.log
        )
        if keep_on == "always" or (keep_on == "failure" and not report.ok):
            dump(directory)
            outcome.artifacts = keep(directory, outcome)
        return outcome
    finally:
        if nemesis is not None:
            nemesis.halt.set()
        workers.kill_all()
        drop_triggers()
        shutil.rmtree(directory, ignore_errors=True)
