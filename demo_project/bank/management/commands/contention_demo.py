"""``python manage.py contention_demo``: workers race for one lock, with and without
fencing, and the report shows which run lost updates.

It migrates the database, starts N real worker processes (one process group, killed on
exit, error or Ctrl-C) — ``celery worker``, or with ``--django-tasks`` django-tasks-db's
``db_worker`` — queues M deposits of 1 into one account, each under the lock
``account:<id>`` with a short TTL, and makes some holders stall past their lease.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import OperationalError, connections

from demo_project.bank.interpreter import python_command
from demo_project.bank.workers import RUNNERS, Workers
from distlock import acquire

MODES = ("fenced", "unfenced")
ADMIN_USER = ADMIN_PASSWORD = "demo"


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0 or number == float("inf"):
        raise ValueError(value)
    return number


def _grants(value: str) -> list[int]:
    grants = sorted({int(part) for part in value.split(",") if part.strip()})
    if any(grant < 1 for grant in grants):
        raise ValueError(value)
    return grants


class Command(BaseCommand):
    help = (
        "Run N Celery (or Django Tasks) workers racing for one lock over M deposits, with "
        "holders stalling "
        "past their lease, in fenced and unfenced modes, and report the lost updates."
    )

    # The system checks run in handle(), after the options are checked: on Django 6.x a
    # check run opens the database (creating a SQLite file), and a bad option must be
    # refused before anything is touched.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--workers", type=int, default=3, help="worker processes (>= 2)")
        parser.add_argument("--tasks", type=int, default=12, help="deposits per mode (>= 2)")
        parser.add_argument("--ttl", type=_positive, default=1.0, help="lease seconds")
        parser.add_argument("--work", type=float, default=0.1,
                            help="seconds each holder works between read and write")
        parser.add_argument(
            "--pause-grants", type=_grants, default=None,
            help="grant numbers (1 = first) whose holder stalls past its lease "
                 "(default: 3 and 8, fewer with fewer tasks)",
        )
        parser.add_argument("--pause-max", type=_positive, default=20.0,
                            help="longest stall, in seconds")
        parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
        parser.add_argument("--timeout", type=_positive, default=120.0,
                            help="give up on a mode after this many seconds")
        parser.add_argument("--json", dest="json_path", help="also write the results here")
        parser.add_argument(
            "--no-report", dest="report", action="store_false",
            help="do not write the HTML report (report.html in the run's folder: the "
                 "timeline of grants per worker, stalls, stale writes, balances)",
        )
        parser.add_argument(
            "--django-tasks", dest="runner", action="store_const", const="django-tasks",
            default="celery",
            help="run the deposits as Django Tasks on django-tasks-db db_worker processes "
                 "instead of Celery workers",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        started = time.monotonic()
        workers, tasks = options["workers"], options["tasks"]
        if workers < 2:
            raise CommandError("--workers must be at least 2: a stalled holder needs a rival")
        if tasks < 2:
            raise CommandError("--tasks must be at least 2")
        if options["work"] < 0:
            raise CommandError("--work must not be negative")
        pauses = options["pause_grants"]
        if pauses is None:
            pauses = [grant for grant in (3, 8) if grant < tasks] or [1]
        if max(pauses, default=0) >= tasks:
            raise CommandError(
                f"--pause-grants must be below --tasks ({tasks}): a stalled holder is only "
                "overtaken if another grant comes after it"
            )
        modes = list(MODES) if options["mode"] == "both" else [options["mode"]]
        self.check()
        runner = options["runner"]
        if runner == "django-tasks" and "django_tasks_db" not in settings.INSTALLED_APPS:
            raise CommandError(
                "--django-tasks needs django-tasks-db (pip install django-distlock[tasks])"
            )

        self._prepare()
        self._bases: dict[str, int] = {}
        run = uuid.uuid4().hex[:8]
        queue = f"demo-{run}"
        folder = Path(settings.DEMO_BROKER_DIR) / "runs" / run
        folder.mkdir(parents=True, exist_ok=True)
        self.stdout.write(
            f"distlock contention demo {run}: {workers} {RUNNERS[runner]}, {tasks} deposits "
            f"per mode, lock ttl {options['ttl']} s, grants {', '.join(map(str, pauses))} "
            f"stall past their lease\n  database {settings.DATABASES['default']['ENGINE']}"
            f" {settings.DATABASES['default']['NAME']}, "
            + (f"broker {settings.CELERY_BROKER_URL}\n" if runner == "celery" else
               "tasks in the database (django-tasks-db)\n")
            + f"  admin: http://127.0.0.1:8000/admin/ (login {ADMIN_USER} / {ADMIN_PASSWORD};"
            f" start it with `{python_command()} manage.py runserver`) shows the locks while"
            " this runs"
        )
        previous = signal.signal(signal.SIGTERM, _interrupt)
        pool = Workers(workers, queue, folder, options["ttl"], runner)
        results: dict[str, dict[str, Any]] = {}
        group = pool.pgid
        interrupted = False
        try:
            pool.wait_ready(timeout=60)
            self.stdout.write(
                f"  workers ready after {time.monotonic() - started:.1f} s "
                f"(process group {group}, logs in {folder})"
            )
            for mode in modes:
                results[mode] = self._run_mode(mode, run, queue, pauses, options, runner)
        except KeyboardInterrupt:
            interrupted = True
            raise CommandError("interrupted; the workers were stopped") from None
        finally:
            # Warm shutdown (running tasks finish); on Ctrl-C wait less before SIGKILL.
            stopping = time.monotonic()
            self.stdout.write("\nstopping the workers (each finishes its task first)...")
            pool.stop(grace=3.0 if interrupted else 10.0)
            self.stdout.write(f"  workers stopped after {time.monotonic() - stopping:.1f} s")
            _drop_queue(queue, runner)
            signal.signal(signal.SIGTERM, previous)
            for path in folder.glob("ready-*"):
                path.unlink()
        elapsed = time.monotonic() - started
        self._summary(results, elapsed)
        if options["report"] and results:
            path = self._report(folder / "report.html", run, results, options, runner)
            self.stdout.write(f"  report: {path}")
        if options["json_path"]:
            Path(options["json_path"]).write_text(
                json.dumps(
                    {"run": run, "seconds": elapsed, "process_group": group, "modes": results},
                    indent=2,
                )
            )
        fenced = results.get("fenced")
        if fenced is not None and (fenced["lost_updates"] != 0 or not fenced["complete"]):
            raise CommandError(
                f"fenced mode lost {fenced['lost_updates']} update(s): fencing failed"
            )

    def _prepare(self) -> None:
        """Migrate (the embedded SQLite database starts empty) and create the demo login."""
        from demo_project.celery import prepare_broker_folders

        _connect()
        call_command("migrate", interactive=False, verbosity=0)
        prepare_broker_folders()
        users = get_user_model()
        if not users.objects.filter(username=ADMIN_USER).exists():
            users.objects.create_superuser(ADMIN_USER, "demo@example.com", ADMIN_PASSWORD)

    def _run_mode(
        self, mode: str, run: str, queue: str, pauses: list[int], options: dict[str, Any],
        runner: str,
    ) -> dict[str, Any]:
        from demo_project.bank.models import Account, Attempt

        tasks = options["tasks"]
        account = Account.objects.create(name=f"demo {run} {mode}")
        name = account.get_fence_name()
        # One grant before the tasks: its token numbers the tasks' grants from 1.
        probe = acquire(name, ttl=options["ttl"], timeout=10)
        assert probe is not None
        base = probe.token
        probe.release()
        self.stdout.write(f"\n{mode}: {tasks} deposits into {name}")
        started = time.monotonic()
        for number in range(1, tasks + 1):
            args = (run, mode, account.pk, number, options["work"], base, pauses,
                    options["pause_max"])
            if runner == "celery":
                from demo_project.bank.tasks import deposit

                deposit.apply_async(args, queue=queue)
            else:
                from demo_project.bank import db_tasks

                db_tasks.deposit.using(queue_name=queue).enqueue(*args)
        shown: set[int] = set()
        deadline = started + options["timeout"]
        complete = False
        while True:
            attempts = list(Attempt.objects.filter(run=run, mode=mode).order_by("id"))
            for attempt in attempts:
                if attempt.outcome != Attempt.Outcome.RUNNING and attempt.pk not in shown:
                    shown.add(attempt.pk)
                    self.stdout.write(self._line(attempt, base))
            written = {a.task_no for a in attempts if a.outcome == Attempt.Outcome.WRITTEN}
            if len(written) == tasks:
                complete = True
                break
            if time.monotonic() > deadline:
                self.stderr.write(f"{mode}: gave up after {options['timeout']:.0f} s")
                break
            time.sleep(0.1)
        account.refresh_from_db()
        self._bases[mode] = base
        return self._tally(mode, account, attempts, base, tasks, complete,
                           time.monotonic() - started)

    def _line(self, attempt: Any, base: int) -> str:
        head = (
            f"  grant {attempt.token - base:>2} token {attempt.token}  task {attempt.task_no:>2}"
            f"{' retry ' + str(attempt.retry) if attempt.retry else ''}  {attempt.worker}"
            f"  waited {attempt.waited:4.2f} s  read {attempt.read_balance}"
        )
        stall = ""
        if attempt.paused:
            stall = f"  STALLED {attempt.paused:.2f} s"
            if attempt.taken_over_by:
                stall += f" (lease expired, token {attempt.taken_over_by} took the lock)"
        if attempt.outcome == "refused":
            return f"{head}{stall}  -> write REFUSED (stale token), retrying"
        if attempt.taken_over_by:
            return f"{head}{stall}  -> wrote {attempt.wrote_balance} ANYWAY (stale write)"
        return f"{head}{stall}  -> wrote {attempt.wrote_balance}"

    def _tally(
        self, mode: str, account: Any, attempts: list[Any], base: int, tasks: int,
        complete: bool, seconds: float,
    ) -> dict[str, Any]:
        tokens = sorted(a.token for a in attempts)
        stalled = [a for a in attempts if a.paused]
        refused = [a for a in attempts if a.outcome == "refused"]
        stale_written = [a for a in attempts if a.outcome == "written" and a.taken_over_by]
        waited = [a.waited for a in attempts if a.waited > 0.05]
        return {
            "mode": mode,
            "lock": account.get_fence_name(),
            "seconds": round(seconds, 2),
            "complete": complete,
            "grants": len(attempts),
            "first_token": tokens[0] if tokens else None,
            "last_token": tokens[-1] if tokens else None,
            "tokens_strictly_increasing": len(set(tokens)) == len(tokens),
            "waits": len(waited),
            "longest_wait": round(max(waited, default=0.0), 2),
            "skips": 0,
            "retries": sum(1 for a in attempts if a.retry),
            "stalled": [(a.token, round(a.paused, 2), a.taken_over_by) for a in stalled],
            "stale_writes_refused": [(a.token, a.taken_over_by) for a in refused],
            "stale_writes_accepted": [(a.token, a.taken_over_by) for a in stale_written],
            "workers": sorted({a.worker for a in attempts}),
            "expected": tasks,
            "final": account.balance,
            "lost_updates": tasks - account.balance,
        }

    def _summary(self, results: dict[str, dict[str, Any]], elapsed: float) -> None:
        out = self.stdout.write
        out("\nreport")
        for mode, r in results.items():
            out(f"  {mode} ({r['lock']}, {r['seconds']:.1f} s"
                f"{'' if r['complete'] else ', INCOMPLETE'}):")
            out(f"    grants                {r['grants']} (tokens {r['first_token']}.."
                f"{r['last_token']}, each new grant higher: {r['tokens_strictly_increasing']})"
                f" across workers {', '.join(r['workers'])}")
            out(f"    waits                 {r['waits']} grants waited for the lock "
                f"(longest {r['longest_wait']:.2f} s)")
            out(f"    skips / retries       {r['skips']} / {r['retries']} (on contention the "
                "tasks wait, so none skips; a refused write retries with a new lease)")
            for token, paused, by in r["stalled"]:
                out(f"    stalled holder        token {token} stalled {paused:.2f} s; "
                    + (f"token {by} took over meanwhile" if by else "nobody took over"))
            refused = ", ".join(f"{t} (lock at {b})" for t, b in r["stale_writes_refused"])
            accepted = ", ".join(f"{t} (lock at {b})" for t, b in r["stale_writes_accepted"])
            out(f"    stale writes refused  {len(r['stale_writes_refused'])}"
                + (f": tokens {refused}" if refused else ""))
            out(f"    stale writes accepted {len(r['stale_writes_accepted'])}"
                + (f": tokens {accepted}" if accepted else ""))
            out(f"    balance               {r['final']}, expected {r['expected']}: "
                f"lost updates {r['lost_updates']}")
        if "fenced" in results and "unfenced" in results:
            f, u = results["fenced"], results["unfenced"]
            out(f"\n  fenced lost {f['lost_updates']} update(s), unfenced lost "
                f"{u['lost_updates']}: the lock alone did not stop a stalled holder; "
                "the fencing token did.")
        out(f"  wall time {elapsed:.1f} s")


    def _report(self, path: Path, run: str, results: dict[str, dict[str, Any]],
                options: dict[str, Any], runner: str) -> Path:
        """The HTML report, from each mode's audit events and attempts (read now, once
        the workers have stopped and recorded their last releases)."""
        from demo_project.bank import report
        from demo_project.bank.models import Attempt
        from distlock.conf import conf
        from distlock.models import LockEvent

        pictures = {}
        for mode, result in results.items():
            events = list(LockEvent.objects.using(conf.database())
                          .filter(name=result["lock"]).order_by("at_us", "id"))
            attempts = list(Attempt.objects.filter(run=run, mode=mode))
            pictures[mode] = report.mode_picture(
                result["lock"], events, attempts, self._bases[mode])
        intro = (
            f"{options['workers']} {RUNNERS[runner]} deposit 1 into an account "
            f"{options['tasks']} times under one lock (ttl {options['ttl']} s); some holders "
            "stall past their lease. "
            "Fenced, the database refuses the stalled holder's write; unfenced, it "
            "overwrites the newer holder's deposit."
        )
        return report.write(path, {"run": run}, results, pictures, intro)


def _connect() -> None:
    """Connect to the demo's database before anything else uses it: a database that is
    not there is one line saying what to create, not migrate's 95-line traceback."""
    connection = connections["default"]
    try:
        connection.ensure_connection()
    except OperationalError as exc:
        raise CommandError(unreachable(connection.settings_dict, exc)) from None


def unreachable(entry: dict[str, Any], exc: Exception) -> str:
    """What to do about a failed connection to the database ``entry`` describes."""
    name = str(entry["NAME"])
    host = f"{entry.get('HOST') or 'localhost'}:{entry.get('PORT') or 'default port'}"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    engine = str(entry["ENGINE"])
    if engine.endswith("sqlite3"):
        return (f"cannot open the demo database file {name!r} ({reason}); check "
                "DATABASE_URL and that its folder exists")
    if engine.endswith("postgresql") and f'database "{name}" does not exist' in str(exc):
        create = ["createdb"] + _flags(entry, "-h", "-p", "-U") + [name]
    elif engine.endswith("mysql") and exc.args[:1] == (1049,):  # ER_BAD_DB_ERROR
        create = ["mysql"] + _flags(entry, "-h", "-P", "-u") + [
            "-e", f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"]
    else:
        return (f"cannot connect to the demo database {name!r} on {host} ({reason}); "
                "check DATABASE_URL and that the server is running")
    return (f"database {name!r} does not exist on {host}; create it (or point "
            f"DATABASE_URL at one that exists): {shlex.join(create)}")


def _flags(entry: dict[str, Any], host: str, port: str, user: str) -> list[str]:
    """The client's host, port and user options for the database ``entry`` describes."""
    flags = []
    for flag, key in ((host, "HOST"), (port, "PORT"), (user, "USER")):
        if entry.get(key):
            flags += [flag, str(entry[key])]
    return flags


def _drop_queue(queue: str, runner: str) -> None:
    """Delete the run's queue and any message left in it (after Ctrl-C), best effort."""
    if runner == "django-tasks":
        from django_tasks_db.models import DBTaskResult

        # Tasks nobody will run (no worker takes this run's queue any more).
        DBTaskResult.objects.filter(queue_name=queue, status="READY").delete()
        return
    from kombu import Exchange, Queue

    from demo_project.celery import app

    with contextlib.suppress(Exception), app.connection_for_write() as conn:
        # Declared as Celery declares it, so that deleting it also drops its binding.
        bound = Queue(queue, Exchange(queue), routing_key=queue)(conn.default_channel)
        bound.declare()
        bound.delete()
    options = app.conf.broker_transport_options or {}
    if "control_folder" in options:  # the filesystem transport keeps one file per exchange
        with contextlib.suppress(OSError):
            (Path(options["control_folder"]) / f"{queue}.exchange").unlink()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
