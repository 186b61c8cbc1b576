"""``python manage.py contention_demo``: Celery workers race for one lock, with and without
fencing, and the report shows which run lost updates.

It migrates the database, starts N real ``celery worker`` processes (one process group,
killed on exit, error or Ctrl-C), queues M deposits of 1 into one account, each under the
lock ``account:<id>`` with a short TTL, and makes some holders stall past their lease.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

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


class Workers:
    """N ``celery worker`` processes in one new process group, stopped by that group id."""

    def __init__(self, count: int, queue: str, folder: Path, ttl: float) -> None:
        self.folder = folder
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []
        self.pgid: int | None = None
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "demo_project.settings",
            "DEMO_LOCK_TTL": str(ttl),
            "DEMO_READY_DIR": str(folder),
            "PYTHONPATH": os.pathsep.join(
                [str(settings.BASE_DIR), os.environ.get("PYTHONPATH", "")]
            ),
        }
        try:
            for number in range(1, count + 1):
                self._start(number, queue, env)
        except BaseException:
            self.stop(grace=0)
            raise

    def _start(self, number: int, queue: str, env: dict[str, str]) -> None:
        # The first worker leads a new process group (outside the terminal's, so Ctrl-C
        # reaches only this command, which then stops the group); the others join it.
        with open(self.folder / f"worker{number}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "demo_project.celery", "worker",
                 "-P", "prefork", "-c", "1", "-Q", queue, "-n", f"demo{number}@%h",
                 "--without-gossip", "--without-mingle", "--without-heartbeat",
                 "-l", "warning"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=settings.BASE_DIR, process_group=self.pgid or 0,
            )
        self.procs.append(proc)
        if self.pgid is None:
            self.pgid = proc.pid

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(list(self.folder.glob("ready-*"))) < self.count:
            for number, proc in enumerate(self.procs, 1):
                if proc.poll() is not None:
                    raise CommandError(
                        f"celery worker {number} exited with {proc.returncode}:\n"
                        + self.tail(number)
                    )
            if time.monotonic() > deadline:
                raise CommandError(f"the workers were not ready within {timeout:.0f} s")
            time.sleep(0.1)

    def tail(self, number: int, lines: int = 20) -> str:
        path = self.folder / f"worker{number}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the group (warm shutdown), SIGKILL whatever is left after ``grace`` s."""
        if self.pgid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        # The workers' pool children are the group too; they are gone only once reaped.
        gone_by = time.monotonic() + 5
        while time.monotonic() < gone_by:
            try:
                os.killpg(self.pgid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        self.pgid = None


class Command(BaseCommand):
    help = (
        "Run N Celery workers racing for one lock over M deposits, with holders stalling "
        "past their lease, in fenced and unfenced modes, and report the lost updates."
    )

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

        self._prepare()
        run = uuid.uuid4().hex[:8]
        queue = f"demo-{run}"
        folder = Path(settings.DEMO_BROKER_DIR) / "runs" / run
        folder.mkdir(parents=True, exist_ok=True)
        self.stdout.write(
            f"distlock contention demo {run}: {workers} Celery workers, {tasks} deposits per "
            f"mode, lock ttl {options['ttl']} s, grants {', '.join(map(str, pauses))} stall "
            f"past their lease\n  database {settings.DATABASES['default']['ENGINE']}"
            f" {settings.DATABASES['default']['NAME']}, broker {settings.CELERY_BROKER_URL}\n"
            f"  admin: http://127.0.0.1:8000/admin/ (login {ADMIN_USER} / {ADMIN_PASSWORD};"
            " start it with `python manage.py runserver`) shows the locks while this runs"
        )
        previous = signal.signal(signal.SIGTERM, _interrupt)
        pool = Workers(workers, queue, folder, options["ttl"])
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
                results[mode] = self._run_mode(mode, run, queue, pauses, options)
        except KeyboardInterrupt:
            interrupted = True
            raise CommandError("interrupted; the workers were stopped") from None
        finally:
            # Warm shutdown (running tasks finish); on Ctrl-C wait less before SIGKILL.
            pool.stop(grace=3.0 if interrupted else 10.0)
            _drop_queue(queue)
            signal.signal(signal.SIGTERM, previous)
            for path in folder.glob("ready-*"):
                path.unlink()
        elapsed = time.monotonic() - started
        self._summary(results, elapsed)
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

        call_command("migrate", interactive=False, verbosity=0)
        prepare_broker_folders()
        users = get_user_model()
        if not users.objects.filter(username=ADMIN_USER).exists():
            users.objects.create_superuser(ADMIN_USER, "demo@example.com", ADMIN_PASSWORD)

    def _run_mode(
        self, mode: str, run: str, queue: str, pauses: list[int], options: dict[str, Any],
    ) -> dict[str, Any]:
        from demo_project.bank.models import Account, Attempt
        from demo_project.bank.tasks import deposit

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
            deposit.apply_async(
                (run, mode, account.pk, number, options["work"], base, pauses,
                 options["pause_max"]),
                queue=queue,
            )
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


def _drop_queue(queue: str) -> None:
    """Delete the run's queue and any message left in it (after Ctrl-C), best effort."""
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
