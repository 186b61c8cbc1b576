"""The contention demo, run as a user runs it: ``manage.py contention_demo`` with small
numbers, on the embedded defaults (a fresh SQLite file, the filesystem broker) in the
SQLite run, and on a fresh database of the configured server (with Redis in the PostgreSQL
run, as for the Celery tests) in the PostgreSQL and MariaDB runs.

It cannot flake on timing: a stalled holder stays stalled until its lease has expired and
the next holder has read the balance, so every stall is overtaken in both modes.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from django.conf import settings

from demo_project.bank.interpreter import python_command
from tests.support.celery_app import broker_url
from tests.support.processes import ROOT

pytestmark = pytest.mark.processes


def _server_database(create: bool) -> str:
    """Create (or drop) the demo's own database on the test server; return its URL."""
    server = settings.DATABASES["default"]
    name = f"test_distlock_demo{os.environ.get('DISTLOCK_TEST_DB_SUFFIX', '')}"
    auth = quote(str(server["USER"]))
    if server.get("PASSWORD"):
        auth += ":" + quote(str(server["PASSWORD"]))
    where = f"{auth}@{server['HOST']}:{server['PORT']}"
    if server["ENGINE"].endswith("postgresql"):
        import psycopg

        with psycopg.connect(f"postgresql://{where}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            if create:
                conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://{where}/{name}"
    import MySQLdb

    conn = MySQLdb.connect(
        host=server["HOST"], port=int(server["PORT"] or 3306), user=server["USER"],
        password=server.get("PASSWORD") or "",
    )
    try:
        conn.cursor().execute(f"DROP DATABASE IF EXISTS `{name}`")
        if create:
            conn.cursor().execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
    finally:
        conn.close()
    return f"mysql://{where}/{name}"


@pytest.fixture
def demo_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The demo's environment: embedded defaults on SQLite, else the test servers."""
    env = {
        key: value for key, value in os.environ.items()
        if not key.startswith(("DATABASE_URL", "CELERY_", "DJANGO_SETTINGS", "DISTLOCK_TEST"))
    }
    env["DEMO_BROKER_DIR"] = str(tmp_path / "broker")
    if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"):
        env["DATABASE_URL"] = f"sqlite:///{tmp_path / 'demo.sqlite3'}"
        yield env
        return
    env["DATABASE_URL"] = _server_database(create=True)
    if broker_url() != "filesystem://":
        env["CELERY_BROKER_URL"] = broker_url()
    try:
        yield env
    finally:
        _server_database(create=False)


def run_demo(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", "contention_demo", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_demo_fenced_loses_nothing_and_unfenced_loses_updates(tmp_path, demo_env):
    out = tmp_path / "result.json"
    done = run_demo(
        demo_env, "--workers", "2", "--tasks", "5", "--pause-grants", "2", "--ttl", "0.5",
        "--work", "0.05", "--json", str(out),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())["modes"]
    fenced, unfenced = result["fenced"], result["unfenced"]
    assert fenced["complete"] and unfenced["complete"]
    # Fenced: the stalled holder's write was refused, it retried, nothing was lost.
    assert fenced["lost_updates"] == 0 and fenced["final"] == 5
    assert len(fenced["stale_writes_refused"]) == 1 and fenced["stale_writes_accepted"] == []
    assert fenced["retries"] == 1 and fenced["grants"] == 6
    # Unfenced: the same stall overwrote the next holder's deposit.
    assert unfenced["lost_updates"] >= 1 and unfenced["final"] <= 4
    assert len(unfenced["stale_writes_accepted"]) == 1
    for mode in (fenced, unfenced):
        assert mode["tokens_strictly_increasing"] and len(mode["workers"]) == 2
        ((token, _, taken_by),) = mode["stalled"]
        assert taken_by == token + 1
    assert "lost updates 0" in done.stdout and "admin: http://127.0.0.1:8000/admin/" in done.stdout
    assert "stopping the workers" in done.stdout and "workers stopped after" in done.stdout
    check_report(done.stdout, fenced, unfenced)
    # The workers were stopped: nothing is left in their process group.
    with pytest.raises(ProcessLookupError):
        os.killpg(json.loads(out.read_text())["process_group"], 0)


def check_report(stdout: str, fenced: dict, unfenced: dict) -> None:
    """The HTML report the demo printed the path of: one self-contained file with both
    runs' timelines, their balances and the fenced run's refused stale write."""
    (line,) = [line for line in stdout.splitlines() if line.strip().startswith("report: ")]
    path = Path(line.split("report: ", 1)[1])
    html = path.read_text(encoding="utf-8")
    assert not re.search(r'(?:src|href)="|url\(|@import|<script', html)  # nothing fetched
    assert re.findall(r'<section id="(\w+)">', html) == ["fenced", "unfenced"]
    for mode, result in (("fenced", fenced), ("unfenced", unfenced)):
        section = html.split(f'<section id="{mode}">')[1].split("</section>")[0]
        assert f"Balance <b>{result['final']}</b>, expected {result['expected']}" in section
        assert section.count('class="distlock-timeline"') == 1
        tokens = re.findall(r'class="dl-bar [^"]*" data-token="(\d+)"', section)
        assert len(tokens) == result["grants"]  # every grant drawn, the probe not
        assert f'data-mode="{mode}">{result["final"]} of {result["expected"]}<' in html
    fenced_part = html.split('<section id="fenced">')[1].split("</section>")[0]
    ((stale_token, _),) = fenced["stale_writes_refused"]
    assert f'data-kind="stale_write" data-token="{stale_token}"' in fenced_part
    unfenced_part = html.split('<section id="unfenced">')[1]
    ((accepted_token, _),) = unfenced["stale_writes_accepted"]
    assert f'data-kind="stale_write_accepted" data-token="{accepted_token}"' in unfenced_part


def test_demo_with_django_tasks_workers(tmp_path, demo_env):
    """--django-tasks: the same story with django-tasks-db db_worker processes."""
    out = tmp_path / "result.json"
    done = run_demo(
        demo_env, "--django-tasks", "--workers", "2", "--tasks", "4", "--pause-grants", "2",
        "--ttl", "0.5", "--work", "0.05", "--json", str(out), "--no-report",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 Django Tasks db_worker processes" in done.stdout
    assert "report:" not in done.stdout  # --no-report
    assert not list((Path(demo_env["DEMO_BROKER_DIR"]) / "runs").glob("*/report.html"))
    result = json.loads(out.read_text())["modes"]
    fenced, unfenced = result["fenced"], result["unfenced"]
    assert fenced["lost_updates"] == 0 and fenced["final"] == 4 and fenced["complete"]
    assert len(fenced["stale_writes_refused"]) == 1 and fenced["retries"] == 1
    assert unfenced["lost_updates"] >= 1 and len(unfenced["stale_writes_accepted"]) == 1
    for mode in (fenced, unfenced):
        assert mode["tokens_strictly_increasing"] and len(mode["workers"]) == 2
    with pytest.raises(ProcessLookupError):
        os.killpg(json.loads(out.read_text())["process_group"], 0)
    # The runserver hint names the interpreter that has Django: the one running the demo.
    assert f"start it with `{python_command(ROOT)} manage.py runserver`" in done.stdout


def test_the_runserver_hint_names_the_venv_python(tmp_path, monkeypatch):
    venv_python = tmp_path / ".venv" / "bin" / "python"
    monkeypatch.setattr(sys, "executable", str(venv_python))
    assert python_command(tmp_path) == ".venv/bin/python"
    assert python_command(tmp_path / "elsewhere") == str(venv_python)
    monkeypatch.setattr(sys, "executable", "/opt/my python/bin/python3")
    assert python_command(tmp_path) == "'/opt/my python/bin/python3'"


def test_ctrl_c_stops_the_workers(tmp_path, demo_env):
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "contention_demo", "--tasks", "200"],
        cwd=ROOT, env={**demo_env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    try:
        group = None
        for line in proc.stdout:
            if "process group" in line:
                group = int(line.split("process group ")[1].split(",")[0])
            if group is not None and "grant" in line:  # tasks are running: interrupt now
                break
        assert group is not None, proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and "interrupted; the workers were stopped" in err
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "1"], "at least 2"),
        (["--tasks", "3", "--pause-grants", "3"], "below --tasks"),
        (["--ttl", "-1"], "--ttl"),
        (["--mode", "sometimes"], "--mode"),
    ],
)
def test_demo_refuses_bad_options(tmp_path, args, message):
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{tmp_path / 'demo.sqlite3'}",
           "DEMO_BROKER_DIR": str(tmp_path / "broker")}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = run_demo(env, *args, timeout=60)
    assert done.returncode != 0
    assert message in done.stderr
    assert not (tmp_path / "demo.sqlite3").exists()  # refused before touching anything


def _missing_database() -> tuple[str, dict]:
    """The URL of a database that does not exist on the test server (or, on SQLite, a
    file in a folder that does not exist), and the server's settings."""
    server = settings.DATABASES["default"]
    if server["ENGINE"].endswith("sqlite3"):
        return "sqlite:////nonexistent-distlock-folder/demo.sqlite3", server
    auth = quote(str(server["USER"]))
    if server.get("PASSWORD"):
        auth += ":" + quote(str(server["PASSWORD"]))
    scheme = "postgresql" if server["ENGINE"].endswith("postgresql") else "mysql"
    name = f"test_distlock_missing_{uuid.uuid4().hex[:12]}"  # no run has created it
    return f"{scheme}://{auth}@{server['HOST']}:{server['PORT']}/{name}", server


def test_demo_on_a_database_that_does_not_exist_says_what_to_create(tmp_path):
    """Issue 27 item 13: a 95-line traceback of migrate. Now one line naming the database,
    the server and the command that creates it, exit status 1, nothing started."""
    url, server = _missing_database()
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("DATABASE_URL", "CELERY_", "DJANGO_SETTINGS", "DISTLOCK_TEST"))}
    env.update(DATABASE_URL=url, DEMO_BROKER_DIR=str(tmp_path / "broker"))
    done = run_demo(env, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert not (tmp_path / "broker").exists()  # refused before the broker or any worker
    if server["ENGINE"].endswith("sqlite3"):
        assert line == ("CommandError: cannot open the demo database file "
                        "'/nonexistent-distlock-folder/demo.sqlite3' (unable to open database "
                        "file); check DATABASE_URL and that its folder exists")
        return
    name = url.rsplit("/", 1)[1]
    where = f"{server['HOST']}:{server['PORT']}"
    said, _, command = line.partition("; create it (or point DATABASE_URL at one that "
                                      "exists): ")
    assert said == f"CommandError: database {name!r} does not exist on {where}"
    if server["ENGINE"].endswith("postgresql"):
        assert shlex.split(command) == [
            "createdb", "-h", server["HOST"], "-p", str(server["PORT"]), "-U", server["USER"],
            name]
        return
    flags = ["mysql", "-h", server["HOST"], "-P", str(server["PORT"]), "-u", server["USER"]]
    *given, sql = shlex.split(command)
    assert given == [*flags, "-e"]
    # The statement it gives creates the database the demo then finds.
    import MySQLdb

    conn = MySQLdb.connect(host=server["HOST"], port=int(server["PORT"]), user=server["USER"],
                           password=server.get("PASSWORD") or "")
    try:
        conn.cursor().execute(sql)
        conn.cursor().execute(f"DROP DATABASE `{name}`")
    finally:
        conn.close()


_BIND = """
import sys, time
from kombu import Connection
import demo_project.kombu_filesystem  # noqa: F401 - the transport under test
folder, queue, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
with Connection("filesystem://", transport_options={
    "data_folder_in": folder, "data_folder_out": folder, "control_folder": folder + "/control",
}) as conn:
    channel = conn.default_channel
    while time.time() < start:  # every process binds at the same moment
        pass
    channel._queue_bind("race", queue, "", queue)
"""


def test_workers_binding_at_once_all_see_a_whole_exchange_table(tmp_path):
    """kombu's own filesystem transport lets a second binder read a table file that the
    first has created but not written (JSONDecodeError, seen in CI) or lose its entry."""
    start = str(time.time() + 2.0)
    procs = [
        subprocess.Popen([sys.executable, "-c", _BIND, str(tmp_path), f"q{i}", start],
                         cwd=ROOT, stderr=subprocess.PIPE, text=True)
        for i in range(8)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    table = json.loads((tmp_path / "control" / "race.exchange").read_text())
    assert sorted(entry[2] for entry in table) == [f"q{i}" for i in range(8)]


def test_the_demos_admin_and_report_show_one_zone():
    """Issue 34: the demo's project had no TIME_ZONE, so its admin showed Chicago (Django's
    default) while its report said UTC; both are the report's zone now."""
    import importlib

    from demo_project.bank import report

    demo_settings = importlib.import_module("demo_project.settings")
    assert demo_settings.TIME_ZONE == str(report.ZONE) == "UTC"
    page = report.html({"run": "r"}, {}, {}, "")
    assert f"Times are the database clock, {report.ZONE}." in page
