"""distlock.leader: elections whose term is the lease's fencing token."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection

from distlock import StaleToken, acquire, break_lock
from distlock.leader import Term, aelect, elect, run_as_leader
from distlock.models import Lock
from tests.factories import AccountFactory
from tests.support.helpers import run_async, start_thread, wait_until, waiting_in

pytestmark = pytest.mark.usefixtures("lock_db")

LEADER = "tests.support.leader_workers:campaign"


@pytest.mark.processes
def test_a_killed_leader_is_followed_by_the_next_term_after_its_lease_ends(children):
    account = AccountFactory()
    first = children.start(LEADER, account.pk, 1.0, True)
    a = first.expect("elected", timeout=60)
    first.expect("wrote")
    second = children.start(LEADER, account.pk, 1.0, True)
    first.kill()
    b = second.expect("elected", timeout=30)
    second.expect("wrote")
    assert b["term"] == a["term"] + 1
    row = Lock.objects.get(name=f"account:{account.pk}")
    # B's grant came after A's last lease ended (A renewed every third of its ttl, so
    # its lease ran past the moment of its first grant by at least its ttl).
    assert b["acquired_us"] >= a["expires_us"]
    account.refresh_from_db()
    assert account.note == f"term {b['term']}" and row.token == b["term"]


@pytest.mark.processes
def test_a_paused_leader_that_keeps_writing_is_refused_and_told_it_lost(children):
    """The seed's pause, for an election: the leader is SIGSTOPped past its ttl, the next
    term is elected and writes; the old leader wakes mid-loop, its next fenced write is
    refused, its loop ends, on_lost is called with its term, and it campaigns again."""
    account = AccountFactory()
    first = children.start(LEADER, account.pk, 1.0, False)
    a = first.expect("elected", timeout=60)
    first.expect("wrote")
    first.signal(signal.SIGSTOP)
    second = children.start(LEADER, account.pk, 1.0, True)
    b = second.expect("elected", timeout=30)
    second.expect("wrote")
    first.signal(signal.SIGCONT)
    assert first.expect("lost", timeout=30)["term"] == a["term"]
    assert b["term"] == a["term"] + 1
    account.refresh_from_db()
    assert account.note == f"term {b['term']}", "the deposed leader's write went through"
    assert Lock.objects.get(name=f"account:{account.pk}").token == b["term"]


def test_run_as_leader_resigns_when_the_loop_returns_and_reports_its_term():
    account = AccountFactory()
    seen: list[Any] = []
    stop = threading.Event()  # set on a loss, so a wrong campaign ends after one round

    def loop(term: Term) -> None:
        seen.append(("loop", term.token, term.active))
        account.save(fence=term.lease)

    run_as_leader(account.get_fence_name(), loop, ttl=30, stop=stop,
                  on_elected=lambda term: seen.append(("elected", term.token)),
                  on_lost=lambda term: (seen.append(("lost", term.token)), stop.set()))
    row = Lock.objects.get(name=account.get_fence_name())
    assert seen == [("elected", row.token), ("loop", row.token, True)]
    assert row.owner == "", "the leader did not step down"


def test_a_stale_write_under_another_lease_is_the_loops_error_and_propagates():
    """Only a refused write under the term's own lease ends the term quietly: one under
    another lease (here a broken one) is the loop's own error, raised after resigning."""
    account = AccountFactory()
    other = acquire(account.get_fence_name(), ttl=30)
    assert break_lock(account.get_fence_name(), by="test") is True
    stop = threading.Event()  # set on a loss, so a wrong campaign ends after one round
    seen: list[Any] = []

    def loop(term: Term) -> None:
        seen.append(("loop", term.token))
        account.save(fence=other)

    with pytest.raises(StaleToken):
        run_as_leader("other-lease", loop, ttl=30, stop=stop,
                      on_lost=lambda term: (seen.append(("lost", term.token)), stop.set()))
    row = Lock.objects.get(name="other-lease")
    assert seen == [("loop", row.token)] and row.owner == "", "not resigned, or called lost"


def test_stop_ends_the_campaign_and_a_sleeping_loop_without_calling_on_lost():
    stop = threading.Event()
    rounds: list[int] = []
    lost: list[int] = []

    def loop(term: Term) -> None:
        while term.sleep(30):
            rounds.append(term.token)

    thread = start_thread(lambda: run_as_leader("stopped", loop, ttl=30, stop=stop,
                                                on_lost=lambda t: lost.append(t.token)))
    wait_until(lambda: Lock.objects.filter(name="stopped").exclude(owner="").exists(),
               what="elected")
    # Asleep for up to 30 s (the ttl) when stop is set: only waking it ends it in time.
    wait_until(lambda: waiting_in(thread, Term.sleep), what="the loop asleep in term.sleep")
    stop.set()
    thread.join(10)
    assert not thread.is_alive(), "stop did not end the campaign"
    assert rounds == [] and lost == []
    assert Lock.objects.get(name="stopped").owner == ""


def test_a_broken_term_ends_its_loop_and_the_campaign_elects_the_next_term():
    """An operator breaks the leader's lock: its next renewal fails, its sleep returns
    False, on_lost gets the term, and the next campaign round is elected with term + 1."""
    terms: list[int] = []
    lost: list[int] = []
    stop = threading.Event()

    def loop(term: Term) -> None:
        terms.append(term.token)
        if len(terms) == 2:
            return  # the second term: done
        while term.sleep(5):
            pass

    thread = start_thread(lambda: run_as_leader("broken", loop, ttl=1, stop=stop,
                                                on_lost=lambda t: lost.append(t.token)))
    try:
        wait_until(lambda: terms, what="elected")
        assert break_lock("broken", by="test") is True
        thread.join(20)
        assert not thread.is_alive()
    finally:
        stop.set()
    assert terms == [terms[0], terms[0] + 1] and lost == [terms[0]]


def test_elect_returns_none_while_another_leads_and_a_resigned_term_is_over():
    term = elect("solo", ttl=30)
    assert term is not None and term.active and term.token == term.lease.token
    assert elect("solo", ttl=30, timeout=0) is None
    assert term.resign() is True
    assert not term.active and not term.sleep(1) and not term.lost
    again = elect("solo", ttl=30, timeout=0)
    assert again is not None and again.token == term.token + 1
    account = AccountFactory()
    with pytest.raises(ValueError, match="guarded by lock 'account:"):
        account.save(fence=again.lease)  # a term fences only its own election's rows
    again.resign()


def test_aelect_renews_in_the_event_loop_until_resigned():
    async def main() -> tuple[int, int, bool]:
        term = await aelect("async-leader", ttl=1)
        assert term is not None
        start = term.token
        row = await Lock.objects.aget(name="async-leader")
        while row.renew_count < 2:
            await asyncio.sleep(0.05)
            row = await Lock.objects.aget(name="async-leader")
        active = term.active
        await term.aresign()
        return start, row.token, active

    start, token, active = run_async(main, seconds=30)
    assert start == token and active
    assert Lock.objects.get(name="async-leader").owner == ""


def _manage(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONUNBUFFERED": "1",
           "DISTLOCK_TEST_CHILD_DB": connection.settings_dict["NAME"]}
    return subprocess.Popen(
        [sys.executable, "-m", "django", *args], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=settings.BASE_DIR,
    )


@pytest.mark.processes
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_the_leader_command_leads_until_sigterm_or_sigint_and_steps_down(stop_signal):
    leader = _manage("distlock_leader", "cron", "tests.support.leader_workers.idle",
                     "--ttl", "5")
    lines: list[str] = []

    def read() -> None:
        assert leader.stdout is not None
        for line in leader.stdout:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # Elected means on_elected ran, not only that the row was granted: a SIGTERM
        # between the two steps down without leading (and prints no "elected").
        wait_until(lambda: lines, timeout=60, what="the command elected")
        row = Lock.objects.get(name="cron")
        assert lines == [f"elected: term {row.token}"]
        assert row.owner and row.holder.endswith("distlock_leader cron")
        leader.send_signal(stop_signal)
        assert leader.wait(timeout=60) == 0, leader.stderr.read() if leader.stderr else ""
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait(60)
        reader.join(10)
        for pipe in (leader.stdout, leader.stderr):
            if pipe is not None:
                pipe.close()
    assert lines == [f"elected: term {row.token}", f"{stop_signal.name}: stepping down",
                     "stopped"]
    assert Lock.objects.get(name="cron").owner == "", "the leader did not step down"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cron", "tests.support.leader_workers.nothing_here"], "callable: cannot import"),
        (["cron", "tests.support.leader_workers.__doc__"], "is not callable"),
        (["cron", "tests.support.leader_workers.idle", "--ttl", "0"], "ttl"),
        (["cron", "tests.support.leader_workers.idle", "--ttl", "soon"], "--ttl: 'soon'"),
        (["x" * 300, "tests.support.leader_workers.idle"], "name"),
    ],
)
def test_the_leader_command_refuses_bad_input_and_campaigns_for_nothing(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("distlock_leader", *args)
    assert not Lock.objects.exists()


def test_the_leader_command_exits_when_its_loop_returns():
    out = StringIO()
    call_command("distlock_leader", "once", "tests.support.leader_workers.done_at_once",
                 stdout=out)
    row = Lock.objects.get(name="once")
    assert out.getvalue().splitlines() == [f"elected: term {row.token}",
                                           "done: the loop returned"]
    assert row.owner == ""
