"""The distlock_* management commands, through call_command with captured output, and a
real `manage.py` process for the exit status."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import ProgrammingError, connection, transaction

from distlock import (
    LockLost,
    StaleToken,
    TokenExhausted,
    TransactionNotAllowed,
    acquire,
    purge_locks,
    raise_tokens,
)
from distlock.backends import backend_for
from distlock.constants import MAX_TOKEN
from distlock.db import db_now_us
from distlock.management.commands.distlock_doctor import independence
from distlock.models import Lock, LockEvent, TokenFloor
from distlock.ops.failover import RaisedTokens
from distlock.signals import lock_broken
from tests.factories import AccountFactory
from tests.support.helpers import expired_lock, us
from tests.support.processes import child_env

pytestmark = pytest.mark.usefixtures("lock_db")


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.fixture
def lock_prefix() -> str:
    """Name three_locks' locks cmd:held, cmd:expired and cmd:free."""
    return "cmd"


# --- distlock_list ------------------------------------------------------------------


def test_list_table(three_locks):
    held = three_locks[0]
    lines = run("distlock_list").splitlines()
    assert lines[0].split() == ["name", "state", "token", "holder", "expires", "renews"]
    by_name = {line.split()[0]: line for line in lines[1:]}
    assert set(by_name) == {"cmd:held", "cmd:expired", "cmd:free"}
    assert by_name["cmd:held"].split()[1:3] == ["held", str(held.token)]
    assert "worker-A" in by_name["cmd:held"] and " s" in by_name["cmd:held"]
    assert "in 2" in by_name["cmd:held"] or "in 30 s" in by_name["cmd:held"]
    assert by_name["cmd:expired"].split()[1] == "expired"
    assert re.search(r"  (now|\d+ s ago) +0$", by_name["cmd:expired"])
    assert by_name["cmd:free"].split()[1] == "free"


def test_list_held_only(three_locks):
    lines = run("distlock_list", "--held").splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["cmd:held"]


def test_list_empty():
    assert run("distlock_list").strip() == "No locks."
    assert run("distlock_list", "--held").strip() == "No locks held."


def test_list_json(three_locks):
    held = three_locks[0]
    data = json.loads(run("distlock_list", "--json"))
    by_name = {item["name"]: item for item in data}
    item = by_name["cmd:held"]
    assert item["state"] == "held" and item["token"] == held.token
    assert item["owner"] == held.owner and item["holder"].endswith("worker-A")
    assert 20 < item["expires_in_s"] <= 30
    assert item["expires_at"] == held.expires_at.isoformat()
    assert item["acquired_at"] == held.acquired_at.isoformat()
    assert by_name["cmd:expired"]["state"] == "expired"
    assert by_name["cmd:expired"]["expires_in_s"] < 0
    assert by_name["cmd:free"]["state"] == "free"
    assert by_name["cmd:free"]["released_at"] and by_name["cmd:free"]["expires_at"] is None
    held_only = json.loads(run("distlock_list", "--json", "--held"))
    assert [item["name"] for item in held_only] == ["cmd:held"]


def test_list_unknown_database_and_flag():
    with pytest.raises(CommandError, match="not an alias"):
        run("distlock_list", "--database", "nope")
    with pytest.raises(CommandError, match="unrecognized arguments"):
        run("distlock_list", "--hold")


def test_list_times_in_words(settings):
    settings.DISTLOCK_MAX_TTL = 3 * 86400
    acquire("hour", ttl=3600, holder="long")
    acquire("day", ttl=86400 + 7200, holder="longer")
    lines = {line.split()[0]: line for line in run("distlock_list").splitlines()[1:]}
    assert lines["hour"].split()[-3:] == ["59", "min", "0"]
    assert lines["day"].split()[-5:] == ["1", "day", "1", "h", "0"]
    assert " s" not in lines["hour"] and "3599" not in lines["hour"]


def _idle_rows(names: list[str]) -> None:
    """Free rows, as purge_locks would find them, without a grant each."""
    Lock.objects.bulk_create(Lock(name=name, token=1) for name in names)


def test_list_limit_says_how_many_more_rows_there_are(monkeypatch):
    from distlock.management.commands import distlock_list

    _idle_rows([f"row:{i:03}" for i in range(25)])
    lines = run("distlock_list", "--limit", "10").splitlines()
    assert [line.split()[0] for line in lines[1:11]] == [f"row:{i:03}" for i in range(10)]
    assert lines[11:] == ["… and 15 more rows (the first 10 are listed: --prefix narrows, "
                          "--limit 0 lists all)"]
    assert len(run("distlock_list", "--limit", "0").splitlines()) == 1 + 25
    assert len(run("distlock_list").splitlines()) == 1 + 25  # under the default 1000
    assert run("distlock_list", "--limit", "24").splitlines()[-1].startswith(
        "… and 1 more row (")
    assert "more" not in run("distlock_list", "--limit", "25")
    # The count of the rest stops at MORE_CAP: it never reads the whole table.
    monkeypatch.setattr(distlock_list, "MORE_CAP", 5)
    assert run("distlock_list", "--limit", "10").splitlines()[-1].startswith(
        "… and 5 or more rows (the first 10")


def test_list_limit_in_json_keeps_the_output_a_list():
    _idle_rows([f"row:{i:03}" for i in range(5)])
    out, err = StringIO(), StringIO()
    call_command("distlock_list", "--json", "--limit", "2", stdout=out, stderr=err)
    assert [item["name"] for item in json.loads(out.getvalue())] == ["row:000", "row:001"]
    assert "and 3 more rows" in err.getvalue()


def test_list_prefix(three_locks):
    _idle_rows(["cmd", "cmdx:1", "other:1"])
    names = [line.split()[0] for line in run("distlock_list", "--prefix", "cmd:").splitlines()[1:]]
    assert names == ["cmd:expired", "cmd:free", "cmd:held"]
    names = [line.split()[0] for line in run("distlock_list", "--prefix", "cmd").splitlines()[1:]]
    assert names == ["cmd", "cmd:expired", "cmd:free", "cmd:held", "cmdx:1"]
    assert [line.split()[0] for line in run(
        "distlock_list", "--prefix", "=cmd").splitlines()[1:]] == ["cmd"]
    held = run("distlock_list", "--prefix", "cmd:", "--held").splitlines()[1:]
    assert [line.split()[0] for line in held] == ["cmd:held"]
    assert run("distlock_list", "--prefix", "zzz").strip() == "No locks."
    limited = run("distlock_list", "--prefix", "cmd", "--limit", "2").splitlines()
    assert [line.split()[0] for line in limited[1:3]] == ["cmd", "cmd:expired"]
    assert limited[3].startswith("… and 3 more rows")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--limit", "ten"], "--limit: 'ten' is not a whole number"),
        (["--limit", "-1"], "--limit: '-1' is negative; 0 lists every lock"),
        (["--limit", ""], "--limit: '' is not a whole number"),
        (["--prefix", "x" * 300], "--prefix: no lock name can match"),
        (["--prefix", "a\x00b"], "--prefix: no lock name can match"),
        (["--limit", "-1", "--watch", "1"], "--limit: '-1' is negative"),
    ],
)
def test_list_limit_and_prefix_bad_input(args, message):
    _idle_rows(["kept"])
    with pytest.raises(CommandError, match=re.escape(message)):
        run("distlock_list", *args)
    assert list(Lock.objects.values_list("name", "token")) == [("kept", 1)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--watch", "soon"], "--watch: 'soon' is not a number of seconds"),
        (["--watch", "-1"], "is not a number of seconds"),
        (["--watch", "0"], "--watch: '0' is too short; at least 0.2 s"),
        (["--watch", "1", "--json"], "does not go with --json"),
    ],
)
def test_list_watch_bad_input(args, message):
    with pytest.raises(CommandError, match=message):
        run("distlock_list", *args)


def test_list_watch_prints_until_ctrl_c_from_a_real_process():
    """--watch prints a table, then again, until SIGINT (Ctrl-C): then exit status 0."""
    lease = acquire("watched", ttl=600, holder="watcher")
    lines: queue.Queue[str | None] = queue.Queue()
    seen: list[str] = []
    with subprocess.Popen(
        [sys.executable, "-m", "django", "distlock_list", "--watch", "0.2"],
        env=child_env(), cwd=settings.BASE_DIR, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None

        def read() -> None:
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 60
            while sum(line.startswith("name ") for line in seen) < 2:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
                assert line is not None, f"exited early ({proc.wait(10)}): {proc.stderr.read()}"
                seen.append(line)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0, proc.stderr.read()
            while (line := lines.get(timeout=60)) is not None:
                seen.append(line)
            errors = proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
            reader.join(60)
    tables = [i for i, line in enumerate(seen) if line.startswith("name ")]
    assert len(tables) >= 2
    assert "(every 0.2 s; Ctrl-C stops)" in seen[tables[0] - 1]
    watched = [line for line in seen if line.startswith("watched ")]
    assert len(watched) >= 2 and all("held" in line and "min" in line for line in watched)
    assert "Traceback" not in errors
    assert lease.release() is True


class Terminal(StringIO):
    """A stream that says it is a terminal, as a watch's stdout in a terminal is."""

    def isatty(self) -> bool:
        return True


WORKER = "buildhost-17.eu-west.example.com pid=6745 thread=ThreadPoolExecutor-0_3"
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (UTC|[A-Z]{2,5} \(UTC[+-]\d\d:\d\d\)) ")


def test_list_watch_on_a_terminal_redraws_one_screen_that_fits(monkeypatch, settings):
    """Issue 34: --watch appended a table per refresh (428 lines of scrollback after 12 s)
    and wrapped at 100 columns. On a terminal each refresh homes the cursor and clears the
    screen, and every line fits its width and the screen its height."""
    settings.TIME_ZONE = "Asia/Kolkata"
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setenv("LINES", "10")
    lease = acquire("a:worker", ttl=600, holder=WORKER)
    _idle_rows([f"row:{i:03}" for i in range(20)])
    out = Terminal()
    call_command("distlock_list", "--watch", "0.2", "--count", "3", stdout=out,
                 stderr=StringIO())
    text = out.getvalue()
    frames = text.split("\x1b[H\x1b[J")
    assert frames[0] == "" and len(frames) == 4  # three screens, each drawn from the top
    for frame in frames[1:]:
        lines = frame.rstrip("\n").split("\n")
        assert len(lines) <= 10 and max(len(line) for line in lines) <= 60, lines
        assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d IST \(UTC\+05:30\)  \(every 0\.2 s",
                        lines[0])
        assert lines[1].split() == ["name", "state", "token", "holder", "expires", "renews"]
        worker = next(line for line in lines if line.startswith("a:worker "))
        # The holder's middle is elided: its host's start and its thread's end stay.
        assert lease.holder.endswith(WORKER) and len(lease.holder) > 60
        assert "…" in worker and lease.holder[:4] in worker and "-0_3" in worker, worker
        assert "held" in worker and "min" in worker
        # 21 rows, 7 shown (10 lines: stamp, heads, the count of the rest).
        assert lines[-1] == "… and 14 more rows (the terminal shows the first 7: --prefix " \
                            "narrows)"[:59] + "…"
    assert lease.release() is True


def test_list_watch_to_a_pipe_appends_tables_without_escape_codes(settings):
    """Not a terminal (a pipe, a log file): each table after a time stamp and a blank
    line, full width, no escape codes to garble the file."""
    settings.TIME_ZONE = "UTC"
    lease = acquire("a:worker", ttl=600, holder=WORKER)
    out = run("distlock_list", "--watch", "0.2", "--count", "2")
    assert "\x1b" not in out
    blocks = out.rstrip("\n").split("\n\n")
    assert len(blocks) == 2
    for block in blocks:
        lines = block.split("\n")
        assert re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC  \(every 0\.2 s; Ctrl-C stops\)$",
                        lines[0]), lines[0]
        assert lines[1].split()[0] == "name" and WORKER in lines[2]
    assert lease.release() is True


def test_list_count_goes_with_watch():
    with pytest.raises(CommandError, match="--count: it goes with --watch"):
        run("distlock_list", "--count", "2")


@pytest.mark.parametrize(
    ("zone", "stamp"),
    [
        ("UTC", "2026-12-03 12:07:49 UTC"),
        ("Asia/Kolkata", "2026-12-03 17:37:49 IST (UTC+05:30)"),
        ("America/New_York", "2026-12-03 07:07:49 EST (UTC-05:00)"),
        ("Asia/Dubai", "2026-12-03 16:07:49 UTC+04:00"),  # tzdata's "+04": offset only
    ],
)
def test_times_carry_the_site_zone(settings, zone, stamp):
    from datetime import UTC, datetime

    from distlock.management.commands._common import local_time

    settings.TIME_ZONE = zone
    assert local_time(us(datetime(2026, 12, 3, 12, 7, 49, 920824, tzinfo=UTC))) == stamp


def test_elide_keeps_both_ends_and_widths_fit():
    from distlock.management.commands.distlock_list import elide, fit_line, fit_widths

    assert elide(WORKER, len(WORKER)) == WORKER
    cut = elide(WORKER, 30)
    assert len(cut) == 30 and cut.startswith("buildhost") and cut.endswith("Executor-0_3")
    assert elide("abc", 1) == "…" and elide("abc", 0) == ""
    # The holder shrinks first, to 12 at least, then the name; the rest is cut.
    assert fit_widths([10, 7, 3, 70, 8, 6], 60) == [10, 7, 3, 16, 8, 6]
    assert fit_widths([40, 7, 3, 70, 8, 6], 60) == [14, 7, 3, 12, 8, 6]
    assert fit_widths([10, 7, 3, 20, 8, 6], 80) == [10, 7, 3, 20, 8, 6]
    assert fit_line("x" * 61, 60) == "x" * 59 + "…" and fit_line("x" * 60, 60) == "x" * 60


def test_list_watch_redraws_one_screen_in_a_real_terminal():
    """A real process on a pseudo-terminal of 60 × 12: screens drawn from the top, each
    within the window, until SIGINT (Ctrl-C), then exit status 0."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    lease = acquire("a:worker", ttl=600, holder=WORKER)
    _idle_rows([f"row:{i:03}" for i in range(30)])
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 12, 60, 0, 0))
    env = child_env()
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    got = b""
    try:
        with subprocess.Popen(
            [sys.executable, "-m", "django", "distlock_list", "--watch", "0.2"],
            env=env, cwd=settings.BASE_DIR, stdin=child, stdout=child,
            stderr=subprocess.PIPE,
        ) as proc:
            os.close(child)
            child = -1
            try:
                deadline = time.monotonic() + 60
                while got.count(b"\x1b[H\x1b[J") < 3:  # two whole screens
                    left = deadline - time.monotonic()
                    assert left > 0 and proc.poll() is None, (got, proc.poll())
                    if select.select([main], [], [], left)[0]:
                        got += os.read(main, 65536)
                proc.send_signal(signal.SIGINT)
                assert proc.wait(timeout=60) == 0
                assert proc.stderr is not None and b"Traceback" not in proc.stderr.read()
            finally:
                if proc.poll() is None:
                    proc.kill()
    finally:
        os.close(main)
        if child >= 0:
            os.close(child)
    screens = got.decode().replace("\r\n", "\n").split("\x1b[H\x1b[J")[1:3]
    for screen in screens:
        lines = screen.split("\n")
        assert len(lines) <= 12 and max(len(line) for line in lines) <= 60, lines
        assert STAMP.match(lines[0]), lines[0]
        assert any(line.startswith("a:worker ") and "…" in line for line in lines)
        assert lines[-1].startswith("… and 22 more rows (the terminal shows the first 9")
    assert lease.release() is True


# --- distlock_break -----------------------------------------------------------------


def test_break(settings):
    settings.DISTLOCK_AUDIT = True
    lease = acquire("job", ttl=30)
    assert "Broke lock 'job'" in run("distlock_break", "job")
    assert Lock.objects.get(name="job").is_free
    with pytest.raises(LockLost):
        lease.renew()
    assert acquire("job", ttl=30).token == lease.token + 1
    event = LockEvent.objects.get(kind="broken")
    assert event.by.startswith("manage.py distlock_break (") and event.token == lease.token


def test_break_guarded_by_owner_and_token():
    lease = acquire("guarded", ttl=30)
    with pytest.raises(CommandError, match="another grant"):
        run("distlock_break", "guarded", "--token", str(lease.token + 1))
    with pytest.raises(CommandError, match="another grant"):
        run("distlock_break", "guarded", "--owner", "f" * 32)
    assert Lock.objects.get(name="guarded").owner == lease.owner
    run("distlock_break", "guarded", "--owner", lease.owner, "--token", str(lease.token))
    assert Lock.objects.get(name="guarded").is_free


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing"], "no lock named 'missing'"),
        (["free"], "is not held"),
        ([""], "must not be empty"),
        (["x" * 256], "at most 255"),
        (["free", "--owner", "XYZ"], "32 lowercase hex"),
        (["free", "--token", "0"], "between 1 and"),
        (["free", "--token", "abc"], "--token: 'abc' is not a whole number"),
        (["free", "--token", "1.5"], "not a whole number"),
        (["free", "--token", "99999999999999999999999"], "between 1 and"),
        (["free", "--token", "-3"], "between 1 and"),
        ([], "the following arguments are required: name"),
    ],
)
def test_break_bad_input(args, message):
    acquire("free", ttl=30).release()
    before = list(Lock.objects.values_list("name", "token", "owner"))
    with pytest.raises(CommandError, match=message):
        run("distlock_break", *args)
    assert list(Lock.objects.values_list("name", "token", "owner")) == before


# --- distlock_purge -----------------------------------------------------------------


def test_purge_idle_rows_keeps_held_locks_and_tokens_rising(settings):
    settings.DISTLOCK_AUDIT = True
    old = acquire("old", ttl=30)
    old.release()
    held = acquire("held", ttl=30)
    top = acquire("top", ttl=30)
    top.release()
    out = run("distlock_purge", "--idle", "0")
    assert "Deleted 2 lock row(s)" in out
    assert set(Lock.objects.values_list("name", flat=True)) == {"held"}
    assert acquire("old", ttl=30).token > top.token
    assert held.release() is True
    assert "Deleted 0 audit event(s)" in out  # all events are new


def test_purge_old_events_by_database_clock(settings):
    settings.DISTLOCK_AUDIT = True
    acquire("e", ttl=30).release()
    assert LockEvent.objects.count() == 2
    LockEvent.objects.filter(kind="acquired").update(
        at_us=db_now_us("default") - 3 * 86400 * 1_000_000
    )
    out = run("distlock_purge", "--events-older-than", "2d")
    assert "Deleted 1 audit event(s) older than 2 days" in out
    assert list(LockEvent.objects.values_list("kind", flat=True)) == ["released"]
    # The default age is DISTLOCK_AUDIT_RETENTION.
    LockEvent.objects.update(at_us=db_now_us("default") - 3600 * 1_000_000)
    settings.DISTLOCK_AUDIT_RETENTION = 1800
    assert "Deleted 1 audit event(s)" in run("distlock_purge")
    settings.DISTLOCK_AUDIT_RETENTION = None
    acquire("f", ttl=30).release()
    LockEvent.objects.update(at_us=0)
    assert "Kept all audit events" in run("distlock_purge")
    assert LockEvent.objects.count() == 2
    run("distlock_purge", "--skip-events")
    assert LockEvent.objects.count() == 2


def test_purge_respects_idle():
    acquire("recent", ttl=30).release()
    acquire("top", ttl=30).release()
    assert "Deleted 0 lock row(s)" in run("distlock_purge", "--idle", "1h30m")
    assert Lock.objects.count() == 2


def test_purge_speaks_in_words_and_of_audit_events_only_with_audit_on(settings):
    acquire("idle", ttl=30).release()
    out = run("distlock_purge", "--idle", "1h30m")
    assert out.strip() == "Deleted 0 lock row(s) idle for at least 1 h 30 min."
    assert "audit" not in out.lower()  # audit is off
    out = run("distlock_purge", "--idle", "2d", "--events-older-than", "90")
    assert "idle for at least 2 days." in out
    assert "Deleted 0 audit event(s) older than 1 min." in out  # asked for: done and said
    settings.DISTLOCK_AUDIT = True
    out = run("distlock_purge")
    assert "idle for at least 1 day." in out
    assert "Deleted 0 audit event(s) older than 30 days." in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--idle", "soon"], "--idle: 'soon' is not a duration"),
        (["--idle", "-5"], "not a duration"),
        (["--idle", ""], "not a duration"),
        (["--idle", "5x"], "not a duration"),
        (["--events-older-than", "1y"], "--events-older-than: '1y' is not a duration"),
        (["--idle", "99999999999999999999d"], "--idle: '99999999999999999999d' is too long"),
        (["--idle", "9" * 400], "is too long"),
        # The second duration is checked before the first one deletes anything.
        (["--idle", "0", "--events-older-than", "99999999999999999999w"], "too long"),
        (["--events-older-than", "1d", "--skip-events"], "contradict"),
        (["--database", "elsewhere"], "not an alias"),
    ],
)
def test_purge_bad_input_deletes_nothing(args, message):
    acquire("a", ttl=30).release()
    acquire("b", ttl=30).release()
    with pytest.raises(CommandError, match=message):
        run("distlock_purge", *args)
    assert Lock.objects.count() == 2


def test_purge_bad_retention_setting_is_a_command_error(settings):
    settings.DISTLOCK_AUDIT_RETENTION = -1
    acquire("a", ttl=30).release()
    acquire("b", ttl=30).release()
    with pytest.raises(CommandError, match="must be positive"):
        run("distlock_purge", "--idle", "0")
    assert Lock.objects.count() == 2


def test_purge_dry_run_counts_what_it_would_delete_and_deletes_nothing(settings):
    """--dry-run: the counts of lock rows and audit events the purge would delete, by
    the same conditions and the same clock, and not one row changed (then the real purge
    deletes exactly those)."""
    settings.DISTLOCK_AUDIT = True
    for i in range(3):
        acquire(f"idle:{i}", ttl=30).release()
    held = acquire("held", ttl=600)
    gone = expired_lock("gone")
    old = db_now_us("default") - 3 * 86400 * 10**6
    LockEvent.objects.filter(kind="acquired").update(at_us=old)  # 5 grants, 3 days ago
    before = _everything()
    out = run("distlock_purge", "--idle", "0", "--events-older-than", "2d", "--dry-run")
    assert out.splitlines() == [
        "Would delete 4 lock row(s) idle for at least 0 s (dry run: nothing deleted).",
        "Would delete 5 audit event(s) older than 2 days.",
    ]
    assert _everything() == before
    # With the other options: an idle time no row reaches, the retention, no events.
    out = run("distlock_purge", "--idle", "1h", "--dry-run")
    assert "Would delete 0 lock row(s) idle for at least 1 h" in out
    assert "Would delete 0 audit event(s) older than 30 days." in out
    settings.DISTLOCK_AUDIT_RETENTION = 86400
    assert "Would delete 5 audit event(s) older than 1 day." in run(
        "distlock_purge", "--dry-run")
    settings.DISTLOCK_AUDIT_RETENTION = None
    assert "Would keep all audit events" in run("distlock_purge", "--dry-run")
    assert "audit" not in run("distlock_purge", "--dry-run", "--skip-events", "--idle", "0")
    with pytest.raises(CommandError, match="contradict"):
        run("distlock_purge", "--dry-run", "--skip-events", "--events-older-than", "1d")
    assert _everything() == before
    out = run("distlock_purge", "--idle", "0", "--events-older-than", "2d")
    assert "Deleted 4 lock row(s)" in out and "Deleted 5 audit event(s)" in out
    assert list(Lock.objects.values_list("name", flat=True)) == ["held"]
    assert gone.release() is False and held.release() is True


# --- distlock_failover --------------------------------------------------------------


def floor_and_tokens() -> tuple[int | None, list[tuple[str, int, str, int | None]]]:
    floor = TokenFloor.objects.values_list("token", flat=True).first()
    return floor, list(Lock.objects.order_by("name").values_list(
        "name", "token", "owner", "expires_us"))


def test_failover_raises_every_token_and_the_floor_and_ends_every_lease(settings):
    settings.DISTLOCK_AUDIT = True
    broken = []
    lock_broken.connect(receiver := lambda **kw: broken.append(kw), weak=False)
    try:
        account = AccountFactory(pk=7)
        held = acquire("account:7", ttl=30)
        expired = expired_lock("fo:expired")
        free = acquire("fo:free", ttl=30)
        free.release()
        top = max(held.token, expired.token, free.token)
        out = run("distlock_failover", "--margin", "1000")
    finally:
        lock_broken.disconnect(receiver)
    assert (f"Raised the token of 3 lock row(s) and the token floor to {top + 1000} (largest "
            f"token before: {top}, margin 1000); ended 1 held lease(s).") in out
    assert f"ended 'account:7' (token {held.token}" in out
    floor, rows = floor_and_tokens()
    assert floor == top + 1000
    assert {(name, token, owner) for name, token, owner, _ in rows} == {
        ("account:7", top + 1000, ""), ("fo:expired", top + 1000, ""),
        ("fo:free", top + 1000, ""),
    }
    # The held lease ended at the step, by the database clock; the others keep their times.
    expires = {name: expires_us for name, _, _, expires_us in rows}
    assert expires["fo:free"] == us(free.released_at)
    assert expires["fo:expired"] == us(expired.expires_at)
    assert us(held.acquired_at) < expires["account:7"] < us(held.expires_at)
    assert [(b["name"], b["token"], b["owner"]) for b in broken] == [
        ("account:7", held.token, held.owner)]
    assert broken[0]["by"].startswith("manage.py distlock_failover (")
    event = LockEvent.objects.get(name="account:7", kind="broken")
    assert event.by.startswith("manage.py distlock_failover (")
    # The old lease is refused everywhere; every new grant starts above the new floor.
    account.balance = 5
    with pytest.raises(StaleToken):
        account.save(fence=held)
    with pytest.raises(LockLost):
        held.renew()
    assert held.release() is False
    assert acquire("account:7", ttl=30, blocking=False).token == top + 1001
    assert acquire("fo:brand-new", ttl=30).token == top + 1001


def test_failover_starts_above_purged_tokens():
    acquire("fo:low", ttl=30).release()
    purged = acquire("fo:purged", ttl=30)
    for _ in range(5):
        purged.release()
        purged = acquire("fo:purged", ttl=30)
    purged.release()
    assert purge_locks(idle=0) == 2
    # The table is empty now; the floor remembers token 6.
    assert "largest token before: 6" in run("distlock_failover", "--margin", "10")
    assert acquire("fo:low", ttl=30).token == 17


def test_failover_default_margin_and_an_empty_table():
    assert "token floor to 1000000000 (largest token before: 0" in run("distlock_failover")
    assert acquire("first", ttl=30).token == 1_000_000_001


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--margin", "many"], "--margin: 'many' is not a whole number"),
        (["--margin", ""], "--margin: '' is not a whole number"),
        (["--margin", "1.5"], "--margin: '1.5' is not a whole number"),
        (["--margin", "0"], "--margin: margin must be between 1 and"),
        (["--margin", "-3"], "--margin: margin must be between 1 and"),
        (["--margin", str(2**63)], "--margin: margin must be between 1 and"),
        (["--margin", str(2**63 - 1)], "would pass 9223372036854775807"),
        (["--database", "elsewhere"], "not an alias"),
    ],
)
def test_failover_bad_input_changes_nothing(args, message):
    held = acquire("busy", ttl=60)
    acquire("idle", ttl=30).release()
    before = floor_and_tokens()
    with pytest.raises(CommandError, match=message):
        run("distlock_failover", *args)
    assert floor_and_tokens() == before
    assert held.release() is True


def test_failover_up_to_the_last_token_and_not_past_it():
    acquire("near", ttl=30).release()
    Lock.objects.filter(name="near").update(token=MAX_TOKEN - 10)
    before = floor_and_tokens()
    with pytest.raises(CommandError, match="would pass"):
        run("distlock_failover", "--margin", "11")
    assert floor_and_tokens() == before
    run("distlock_failover", "--margin", "10")
    assert floor_and_tokens()[0] == MAX_TOKEN
    with pytest.raises(TokenExhausted):
        acquire("near", ttl=5, blocking=False)


def test_raise_tokens_checks_its_arguments_and_refuses_inside_atomic():
    acquire("x", ttl=30).release()
    before = floor_and_tokens()
    for margin, error in ((True, TypeError), (1.5, TypeError), ("9", TypeError),
                          (0, ValueError), (MAX_TOKEN + 1, ValueError)):
        with pytest.raises(error, match="margin must be"):
            raise_tokens(margin=margin)
    with pytest.raises(TypeError, match="by must be a str"):
        raise_tokens(margin=5, by=None)
    with transaction.atomic(), pytest.raises(TransactionNotAllowed):
        raise_tokens(margin=5)
    assert floor_and_tokens() == before
    assert raise_tokens(margin=5) == RaisedTokens(
        previous=before[1][0][1], floor=before[1][0][1] + 5, rows=1, ended=())


# --- distlock_doctor ----------------------------------------------------------------


def test_doctor_on_the_test_database():
    out = run("distlock_doctor")
    assert "[ok] table distlock_lock exists" in out
    assert "database clock is" in out and "ms" in out
    assert "no problems" in out
    if connection.vendor == "sqlite":
        assert "[ok] SQLite transaction_mode is IMMEDIATE" in out
        assert "[ok] SQLite busy timeout is 30 s" in out
        # The test settings have a second alias on the same file.
        assert "same SQLite file as 'locks'" in out
    elif connection.vendor == "mysql":
        assert "[ok] distlock_lock.name collation is utf8mb4_nopad_bin" in out
        assert "[ok] stored procedures distlock_acquire, distlock_renew, distlock_release " \
               "exist" in out
        # Django's MySQL backend sets READ COMMITTED unless OPTIONS say otherwise.
        assert "isolation level is READ-COMMITTED" in out
        assert "[ok] the lock alias 'default' is its own connection" in out
    else:
        assert "isolation level is read committed" in out
        assert "[ok] distlock's 14 SQL functions exist" in out
        assert "[ok] the lock alias 'default' is its own connection" in out
        if settings.PGBOUNCER:  # the documented settings for the pooler: nothing to fix
            assert "[ok] a transaction pooler (such as PgBouncer" in out
            assert "[ok] DISTLOCK_WAKEUPS is False" in out
        else:
            assert "[ok] no transaction pooler: each connection kept its own server" in out


def test_doctor_names_a_missing_postgresql_function():
    """Without one of distlock's SQL functions (migrations faked, or the schema they ran
    in not on the connection's search_path) distlock_doctor fails and says what to check;
    the release that needs it fails with the database's error and changes nothing, and
    works once the function is back."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's SQL functions")
    lease = acquire("no-function", ttl=30)
    backend = backend_for(connection)
    assert backend.missing_functions(connection) == []
    with connection.cursor() as cursor:
        cursor.execute("SELECT oid::regprocedure::text FROM pg_proc "
                       "WHERE proname = 'distlock_release'")
        [(signature,)] = cursor.fetchall()
        cursor.execute(f"ALTER FUNCTION {signature} RENAME TO distlock_release_hidden")
    try:
        assert backend.missing_functions(connection) == ["distlock_release"]
        out = StringIO()
        with pytest.raises(CommandError, match="1 problem"):
            call_command("distlock_doctor", stdout=out)
        report = out.getvalue()
        assert "[FAIL] function(s) distlock_release missing" in report
        assert "manage.py migrate distlock" in report and "search_path" in report
        with pytest.raises(ProgrammingError, match="distlock_release"):
            lease.release()
        assert Lock.objects.get(name="no-function").owner == lease.owner
    finally:
        hidden = signature.replace("distlock_release", "distlock_release_hidden", 1)
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER FUNCTION {hidden} RENAME TO distlock_release")
    assert backend.missing_functions(connection) == []
    assert "no problems" in run("distlock_doctor")
    assert lease.release() is True
    assert Lock.objects.get(name="no-function").owner == ""


@pytest.mark.skipif(not settings.PGBOUNCER, reason="the PgBouncer pass only (scripts/pgbouncer)")
def test_doctor_behind_a_transaction_pooler_names_the_settings_to_change(settings):
    pooler_prepares = settings.DISTLOCK_PREPARE_STATEMENTS  # True: PgBouncer 1.21+ (see settings)
    settings.DISTLOCK_WAKEUPS = True
    settings.DISTLOCK_PREPARE_STATEMENTS = True
    out = StringIO()
    with pytest.raises(CommandError, match=r"distlock_doctor: \d problem"):
        call_command("distlock_doctor", stdout=out, stderr=StringIO())
    text = out.getvalue()
    assert "[ok] a transaction pooler (such as PgBouncer with pool_mode = transaction) is " \
           "between distlock and the server: two connections were served by the same " \
           "backend" in text
    assert "[FAIL] set DISTLOCK_WAKEUPS = False" in text
    if pooler_prepares:
        assert "keeps prepared statements per connection" in text
    else:
        assert "[FAIL] set DISTLOCK_PREPARE_STATEMENTS = False: this pooler lets one " \
               "connection's prepared statements reach another" in text
    settings.DISTLOCK_WAKEUPS = False
    settings.DISTLOCK_PREPARE_STATEMENTS = pooler_prepares
    assert "no problems, 0 warning(s)" in run("distlock_doctor")


def test_doctor_reports_skew_over_the_limit_as_a_warning():
    # A limit of 0 s: any measurable difference warns, and a warning is not a failure.
    out = run("distlock_doctor", "--max-skew", "0")
    assert "no problems" in out
    for bad in ("-1", "soon", "nan", "inf", "1e400"):
        with pytest.raises(CommandError, match=f"--max-skew: '{bad}' is not a number of sec"):
            run("distlock_doctor", "--max-skew", bad)
    assert "no problems" in run("distlock_doctor", "--max-skew", "1e-3")


@pytest.mark.skipif(
    settings.DATABASES["default"]["ENGINE"] != "django.db.backends.sqlite3",
    reason="SQLite settings only",
)
def test_doctor_fails_on_deferred_sqlite(monkeypatch):
    options = {**connection.settings_dict["OPTIONS"], "transaction_mode": None}
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    out = StringIO()
    with pytest.raises(CommandError, match="1 problem"):
        call_command("distlock_doctor", stdout=out)
    assert "[FAIL] SQLite transaction_mode is DEFERRED" in out.getvalue()


def test_doctor_fails_on_a_folding_collation(folding_name_column):
    out = StringIO()
    with pytest.raises(CommandError, match="1 problem"):
        call_command("distlock_doctor", stdout=out)
    assert f"[FAIL] distlock_lock.name collation is {folding_name_column}" in out.getvalue()


def test_doctor_independence_of_the_lock_alias():
    pg = {"ENGINE": "django.db.backends.postgresql", "NAME": "app", "HOST": "db"}
    only = independence("default", "postgresql", {"default": pg})
    assert [level for level, _ in only] == ["warn"]
    assert "is the connection your code uses" in only[0][1]
    assert "DISTLOCK_DATABASE = 'distlock'" in only[0][1]
    both = {"default": pg, "distlock": {**pg}}
    assert independence("distlock", "postgresql", both) == [
        ("ok", "the lock alias 'distlock' is its own connection to the database of "
               "'default': grants commit on their own, also inside your transactions there"),
    ]
    elsewhere = {"default": pg, "distlock": {**pg, "NAME": "locks"}}
    assert independence("distlock", "postgresql", elsewhere)[0][0] == "warn"
    lite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "/x.sqlite3"}
    same_file = independence("distlock", "sqlite", {"default": lite, "distlock": {**lite}})
    assert same_file[0][0] == "warn" and "same SQLite file as 'default'" in same_file[0][1]
    atomic = independence("default", "postgresql", {
        "default": {**pg, "ATOMIC_REQUESTS": True}, "other": pg,
    })
    assert [level for level, _ in atomic] == ["warn", "ok"]
    assert "ATOMIC_REQUESTS" in atomic[0][1]


def test_doctor_gives_no_second_alias_advice_on_sqlite():
    """On SQLite a second alias of the same file cannot let a lock commit inside a
    transaction (one writer): the doctor says so instead of advising one."""
    lite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "/x.sqlite3"}
    ((level, text),) = independence("default", "sqlite", {"default": lite})
    assert level == "warn" and "raises TransactionNotAllowed" in text
    assert "would not help" in text and "DISTLOCK_DATABASE" not in text


def test_doctor_says_how_to_turn_sqlite_wal_on(tmp_path):
    """The warning's own advice, followed, turns it into an ok."""
    from django.db.utils import ConnectionHandler

    from distlock.backends.sqlite import SQLite

    entry = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "x.sqlite3"),
             "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 5}}
    handler = ConnectionHandler({"default": entry})
    try:
        found = {message: level for level, message in SQLite().doctor(handler["default"])}
    finally:
        handler.close_all()
    (warning,) = [message for message, level in found.items() if level == "warn"]
    assert warning.startswith("SQLite journal_mode is delete: WAL lets readers")
    advice = "OPTIONS['init_command'] = 'PRAGMA journal_mode=WAL;'"
    assert advice in warning
    entry["OPTIONS"]["init_command"] = "PRAGMA journal_mode=WAL;"
    handler = ConnectionHandler({"default": entry})
    try:
        assert ("ok", "SQLite journal_mode is wal") in SQLite().doctor(handler["default"])
    finally:
        handler.close_all()


def test_command_exit_status_from_a_real_process():
    """manage.py exits 1 with the message on stderr: what scripts and cron see."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings",
           "DISTLOCK_TEST_CHILD_DB": connection.settings_dict["NAME"]}
    command = [sys.executable, "-m", "django", "distlock_break", "nobody-has-this"]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=120,
        cwd=settings.BASE_DIR,
    )
    assert done.returncode == 1
    assert "CommandError: There is no lock named 'nobody-has-this'." in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "django", "distlock_list", "--json"], env=env,
        capture_output=True, text=True, timeout=120, cwd=settings.BASE_DIR,
    )
    assert done.returncode == 0 and json.loads(done.stdout) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["distlock_break", "busy", "--token", "abc"], "--token: 'abc' is not a whole number"),
        (["distlock_purge", "--idle", "99999999999999999999d"], "--idle: '99999999999999999999d'"
         " is too long"),
        (["distlock_doctor", "--max-skew", "soon"], "--max-skew: 'soon' is not a number"),
        (["distlock_failover", "--margin", "abc"], "--margin: 'abc' is not a whole number"),
        (["distlock_list", "--limit", "99999999999999999999"], "--limit: "
         "'99999999999999999999' is too large"),
    ],
)
def test_bad_numbers_exit_1_with_a_message_from_a_real_process(args, message):
    """Not argparse's exit status 2 with a usage line, nor a traceback: a CommandError."""
    lease = acquire("busy", ttl=60)
    acquire("idle", ttl=30).release()
    before = list(Lock.objects.order_by("name").values())
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings",
           "DISTLOCK_TEST_CHILD_DB": connection.settings_dict["NAME"]}
    done = subprocess.run(
        [sys.executable, "-m", "django", *args], env=env, capture_output=True, text=True,
        timeout=120, cwd=settings.BASE_DIR,
    )
    assert done.returncode == 1, done.stderr
    assert f"CommandError: {message}" in done.stderr
    assert "Traceback" not in done.stderr and "usage:" not in done.stderr
    assert list(Lock.objects.order_by("name").values()) == before
    assert lease.release() is True


def test_doctor_fails_when_the_audit_table_is_missing(settings):
    settings.DISTLOCK_AUDIT = True
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE distlock_lockevent RENAME TO distlock_lockevent_away")
    try:
        out = StringIO()
        with pytest.raises(CommandError, match="1 problem"):
            call_command("distlock_doctor", stdout=out)
        assert "[FAIL] DISTLOCK_AUDIT is on but table distlock_lockevent is missing" in (
            out.getvalue()
        )
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE distlock_lockevent_away RENAME TO distlock_lockevent")
    settings.DISTLOCK_AUDIT = False
    assert "no problems" in run("distlock_doctor")


def test_doctor_state_reports_expired_locks_recent_events_and_audit_size(
    settings, monkeypatch
):
    """Issue 34: the doctor checked configuration only. --state says what the database
    holds: expired locks (named, oldest first), stale writes refused, leases lost and
    locks broken in the last 24 h, and the audit table's size; warnings, not failures."""
    from distlock.management.commands import distlock_doctor

    settings.DISTLOCK_AUDIT = True
    settings.TIME_ZONE = "Asia/Kolkata"
    quiet = run("distlock_doctor", "--state")
    for line in ("[ok] no expired locks", "[ok] no stale writes refused in the last 24 h",
                 "[ok] no leases lost in the last 24 h", "[ok] 0 lock(s) broken in the last "
                 "24 h", "[ok] audit table: no events"):
        assert line in quiet
    assert "[FAIL]" not in quiet and "[warn] audit" not in quiet

    gone = [expired_lock(f"st:gone{i}", holder=f"dead-{i}") for i in range(3)]
    held = acquire("st:held", ttl=600)
    account = AccountFactory(pk=8)
    stale = expired_lock("account:8")
    newer = acquire("account:8", ttl=600)
    account.balance = 1
    with pytest.raises(StaleToken):
        account.save(fence=stale)
    acquire("st:broken", ttl=600)
    run("distlock_break", "st:broken")
    monkeypatch.setattr(distlock_doctor, "EXPIRED_NAMED", 2)
    plain = run("distlock_doctor")
    out = run("distlock_doctor", "--state")
    # Without --state nothing of the data: the doctor as it was, the same lines.
    assert "expired lock" not in plain and "audit table" not in plain
    assert [line[:12] for line in out.splitlines()[: len(plain.splitlines()) - 1]] == [
        line[:12] for line in plain.splitlines()[:-1]]
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "expired lock(s)" in line)
    assert lines[at].startswith("[warn] 3 expired lock(s), not taken over")
    # The two that ran out first, with their times in the site's zone and their holders.
    assert re.match(r"    'st:gone0' expired (now|\d+ s ago) \(\d{4}-\d\d-\d\d [\d:]+ IST "
                    r"\(UTC\+05:30\)\), holder .*dead-0$", lines[at + 1]), lines[at + 1]
    assert lines[at + 2].startswith("    'st:gone1' expired ")
    assert not lines[at + 3].startswith("    ")
    lost = LockEvent.objects.filter(kind="lost").count()
    assert lost >= 1
    assert re.search(r"\[warn\] 1 stale write\(s\) refused in the last 24 h, the latest on "
                     r"'account:8' at \d{4}-\d\d-\d\d [\d:]+ IST \(UTC\+05:30\)", out)
    assert f"[warn] {lost} lease(s) lost in the last 24 h, the latest on " in out
    assert "[ok] 1 lock(s) broken in the last 24 h, the latest on 'st:broken'" in out
    events = LockEvent.objects.count()
    assert f"[ok] audit table: {events} event(s), the oldest " in out
    assert out.rstrip().endswith("distlock_doctor: no problems, "
                                 f"{plain.count('[warn]') + 3} warning(s)")

    # Older than 24 h: not recent. Older than the retention by more than a day: said.
    LockEvent.objects.update(at_us=db_now_us("default") - 3 * 86400 * 10**6)
    settings.DISTLOCK_AUDIT_RETENTION = 3600
    monkeypatch.setattr(distlock_doctor, "AUDIT_CAP", 3)
    out = run("distlock_doctor", "--state")
    assert "[ok] no stale writes refused in the last 24 h" in out
    assert "[ok] no leases lost in the last 24 h" in out
    assert re.search(r"\[warn\] audit table: 3 or more event\(s\), the oldest 3 days old "
                     r"\(.* IST \(UTC\+05:30\)\), older than DISTLOCK_AUDIT_RETENTION \(1 h\) "
                     "by more than a day: run manage.py distlock_purge from cron", out)
    settings.DISTLOCK_AUDIT = False
    out = run("distlock_doctor", "--state")
    assert "[ok] audit is off (DISTLOCK_AUDIT)" in out and "stale write" in out
    assert "lock(s) broken" not in out
    for lease in (*gone, stale):
        assert lease.release() is False
    assert held.release() is True and newer.release() is True


def test_doctor_state_with_a_failing_check_still_exits_1(settings):
    """--state changes no exit status: a FAIL of the checks is still status 1."""
    settings.DISTLOCK_AUDIT = True
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE distlock_lockevent RENAME TO distlock_lockevent_away")
    try:
        out = StringIO()
        with pytest.raises(CommandError, match="1 problem"):
            call_command("distlock_doctor", "--state", stdout=out)
        assert "[ok] no expired locks" in out.getvalue()
        assert "audit table:" not in out.getvalue()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE distlock_lockevent_away RENAME TO distlock_lockevent")


# --- every numeric option of every command, with hostile values ---------------------

# Every option of a distlock command that takes a number (or a duration), with what the
# command needs to get as far as reading it: distlock_break's name.
NUMERIC_OPTIONS = [
    ("distlock_list", [], "--limit"),
    ("distlock_list", [], "--watch"),
    ("distlock_list", [], "--count"),
    ("distlock_break", ["busy"], "--token"),
    ("distlock_purge", [], "--idle"),
    ("distlock_purge", [], "--events-older-than"),
    ("distlock_doctor", [], "--max-skew"),
    ("distlock_failover", [], "--margin"),
    ("distlock_leader", ["cron", "tests.support.leader_workers.idle"], "--ttl"),
]
# Refused by every one of them: past a signed (and an unsigned) 64-bit integer, past a
# float, past int()'s 4,300 digits; negative; not a number at all; NaN and infinities.
HOSTILE = [
    "99999999999999999999", str(2**63), str(2**64), "9" * 400, "9" * 5000, "1e400",
    "-1", "-99999999999999999999", "-" + "9" * 5000, "-1e400", "-0.5", "abc", "", " ", "nan",
    "NaN", "inf", "-inf", "Infinity", "0x10", "1,000", "½", "1e", "1 2",
]
# Zero where it means nothing (elsewhere it is a documented value: --limit 0 lists all,
# --idle 0 purges every idle row, --max-skew 0 warns of any skew), and just too large.
REFUSED_TOO = {
    "--watch": ["0", "0.1", "86401", "1e10"],
    "--count": ["0", str(10**9 + 1)],
    "--token": ["0", str(MAX_TOKEN + 1)],
    "--margin": ["0", str(MAX_TOKEN + 1)],
    "--limit": [str(10**18 + 1), str(MAX_TOKEN)],
    "--idle": ["1000000000001", "99999999999999999999d"],
    "--events-older-than": ["1000000000001", "99999999999999999999w"],
    "--max-skew": ["1000000000001", "1e13"],
    "--ttl": ["0", "0.0001", "86401", "1000000000001"],
}


def _numeric_cases():
    for command, args, option in NUMERIC_OPTIONS:
        for value in HOSTILE + REFUSED_TOO[option]:
            shown = value if len(value) <= 20 else f"{value[:8]}…x{len(value)}"
            yield pytest.param(command, args, option, value, id=f"{command}{option}={shown!r}")


def _everything() -> tuple:
    """What any of the commands could change: lock rows, the token floor, audit events."""
    return (
        list(Lock.objects.order_by("name").values_list()),
        list(TokenFloor.objects.values_list()),
        list(LockEvent.objects.order_by("pk").values_list()),
    )


@pytest.fixture
def hostile_state(settings):
    """A held lock (what distlock_break and distlock_failover would end), an idle one and
    audit events old enough for any purge (what distlock_purge would delete)."""
    settings.DISTLOCK_AUDIT = True
    lease = acquire("busy", ttl=600)
    acquire("idle", ttl=30).release()
    LockEvent.objects.update(at_us=1)  # 1970: older than any age a purge is given
    Lock.objects.filter(name="idle").update(expires_us=1)  # idle since 1970
    yield
    lease.release()


@pytest.mark.parametrize(("command", "args", "option", "value"), list(_numeric_cases()))
def test_every_numeric_option_refuses_hostile_values_and_changes_nothing(
    hostile_state, command, args, option, value
):
    """Issue 27 item 7: ``distlock_list --limit 99999999999999999999`` was a DataError
    (PostgreSQL), a ProgrammingError (MariaDB) or an IntegrityError (SQLite) traceback.
    Every numeric option of every command gives a CommandError naming the option, and
    nothing changes. ``--option=value``: argparse would take "-inf" for an option."""
    before = _everything()
    with pytest.raises(CommandError) as raised:
        run(command, *args, f"{option}={value}")
    message = str(raised.value)
    assert option.lstrip("-") in message and "Traceback" not in message
    assert len(message) < 1000, message  # a 5,000-digit value is not repeated in full
    assert _everything() == before


@pytest.mark.parametrize(
    ("command", "args", "dest", "value"),
    [
        ("distlock_list", [], "limit", 10**20),
        ("distlock_list", [], "limit", -1),
        ("distlock_list", [], "limit", 1.5),
        ("distlock_list", [], "watch", float("nan")),
        ("distlock_list", [], "watch", float("inf")),
        ("distlock_list", [], "watch", 10**10),
        ("distlock_break", ["busy"], "token", 10**20),
        ("distlock_break", ["busy"], "token", float("nan")),
        ("distlock_purge", [], "idle", 10**20),
        ("distlock_purge", [], "idle", -5),
        ("distlock_purge", [], "events", float("inf")),
        ("distlock_doctor", [], "max_skew", float("nan")),
        ("distlock_doctor", [], "max_skew", -1),
        ("distlock_failover", [], "margin", 10**20),
        ("distlock_failover", [], "margin", float("inf")),
        ("distlock_leader", ["cron", "tests.support.leader_workers.idle"], "ttl", float("nan")),
        ("distlock_leader", ["cron", "tests.support.leader_workers.idle"], "ttl", 10**20),
    ],
)
def test_numbers_given_to_call_command_are_checked_the_same(
    hostile_state, command, args, dest, value
):
    """call_command() passes Python values where the command line passes text: an int or
    a float gets the same CommandError, not an AttributeError or a database's error."""
    before = _everything()
    with pytest.raises(CommandError):
        call_command(command, *args, **{dest: value}, stdout=StringIO(), stderr=StringIO())
    assert _everything() == before


def test_the_largest_values_accepted_run_on_every_backend(hostile_state):
    """The bounds are not too tight either: each DB-touching option's largest value runs,
    with a message rather than a database error, on SQLite, PostgreSQL and MariaDB."""
    before = _everything()
    listed = run("distlock_list", f"--limit={10**18}").splitlines()
    assert [line.split()[0] for line in listed[1:]] == ["busy", "idle"]
    assert "idle" in run("distlock_list", f"--limit={10**18}", "--prefix=idle")
    out = run("distlock_purge", "--idle=1000000000000", "--events-older-than=1000000000000")
    assert "Deleted 0 lock row(s)" in out and "Deleted 0 audit event(s)" in out
    assert "distlock_doctor: no problems" in run("distlock_doctor", "--max-skew=1000000000000")
    with pytest.raises(CommandError, match="another grant"):
        run("distlock_break", "busy", f"--token={MAX_TOKEN}")
    assert _everything() == before


def test_the_numeric_options_above_are_every_numeric_option():
    """A new option that takes a number joins NUMERIC_OPTIONS (and the test above)."""
    from django.core.management import load_command_class

    not_numbers = {
        "--held", "--json", "--prefix", "--owner", "--database", "--skip-events", "name",
        "--state", "--dry-run", "callable",
        "--help", "--version", "--verbosity", "--settings", "--pythonpath", "--traceback",
        "--no-color", "--force-color", "--skip-checks",
    }
    found = set()
    for command in ("distlock_list", "distlock_break", "distlock_purge", "distlock_doctor",
                    "distlock_failover", "distlock_leader"):
        parser = load_command_class("distlock", command).create_parser("manage.py", command)
        for action in parser._actions:
            names = action.option_strings or [action.dest]
            if not set(names) & not_numbers:
                found.add((command, names[0]))
    assert found == {(command, option) for command, _, option in NUMERIC_OPTIONS}
    commands = {path.stem for path in (Path(settings.BASE_DIR) / "distlock" / "management"
                                       / "commands").glob("distlock_*.py")}
    assert commands == {command for command, _, _ in NUMERIC_OPTIONS}
