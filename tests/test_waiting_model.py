"""A model-based test of the waiting machinery (issue 27, "Close the classes").

An explicit random state machine drives real OS worker processes (one of them with two
threads, the others with one: tests/support/model_workers.py) that contend for ONE lock
name. Each step picks one operation the model's state allows: acquire (blocking with a
timeout — some of them end while queued —, ``blocking=False``, ``timeout=0``), release,
cancel (SIGINT while an acquire waits), break_lock (from the test process), expire (a
short ttl run out by the database clock), kill (SIGKILL a holder or waiter; a new
process takes its place), stop and continue (SIGSTOP/SIGCONT), let time pass (wait for
the workers' next event), and on PostgreSQL hold the lock row FOR UPDATE from the test
while a worker with a tiny session ``lock_timeout`` joins the queue (the reproduction of
issue 27 item 2). After every step, with an observer connection (raw psycopg on
PostgreSQL, Django's connection elsewhere):

1. at most one holder by the database clock: of the grants reported and not released or
   broken, at most one is unexpired by the database's clock, and it is the lock row's;
   and a grant comes no earlier than the previous one ended (its release, reported with
   the release's database time, or its expiry);
2. the tokens of the reported grants rise strictly in grant order, none given twice;
3. (PostgreSQL) no advisory lock of the queue's three classes and no ``distlock_waiter``
   row belongs to a live backend that is not waiting (the workers report every session
   they wait on; a killed worker's backend gets a grace deadline to notice its client is
   gone);
4. the lock is never free and unreserved for longer than the README's bound while a
   (not stopped) worker waits: DISTLOCK_POLL_MAX_INTERVAL after the lock became free or
   the hand-off window of a waiter that did not come for it ended (the window itself is
   a reservation, excluded by reading ``reserved_until_us``), plus a slack for the
   machine's load; and what makes it so: no waiter, queued or polling, plans a pause
   between two tries longer than DISTLOCK_POLL_MAX_INTERVAL (each pause is reported by
   the worker). The idle time alone catches a waiter that polls n times too seldom only
   when it happens to be the next to look after an unclaimed window (a few times a run);
   the pauses show it at every wait.

Why an explicit machine and not hypothesis' stateful testing: the system under test is a
set of real processes whose timing no replay reproduces, so hypothesis' shrinking would
chase a different run each time (and its health checks fight steps that take seconds);
a seeded ``random.Random`` gives the same sequence of decisions for a seed
(``DISTLOCK_MODEL_SEED``), which is what a replay can promise here, and the failure
message prints the seed and the last steps. ``DISTLOCK_MODEL_STEPS`` makes a longer run.

Variants: PostgreSQL with wake-ups on and DISTLOCK_LISTENING_WAITERS 8 (everyone
listens) and 1 (the chain), PostgreSQL with wake-ups off; on MariaDB and SQLite the
polling variant (their only one). Five processes (six slots), two of them (one in the
"listen8" variant) with a session ``lock_timeout`` of 5 ms, as in issue 27's reproduction.
Invariant 3 is PostgreSQL's only; 1, 2 and 4 hold everywhere, except that on SQLite the
idle bound is not measured while a process is stopped (a process stopped inside its
write transaction keeps every other one from writing: see ``Model.stalled``).

Known defects this test found in distlock, reported and not fixed here, are tolerated
by name and counted in the summary line (``FOLLOW_LEAK_UNFIXED``, ``CANCEL_LEAK_UNFIXED``,
``MARIADB_INTERRUPT_UNFIXED`` below): set a flag False once its defect is fixed.

What the hand mutations did (issue 27's list): a queued waiter's pause multiplied by
``1 + waiters ahead`` fails the pause check of invariant 4 in both wake-up variants at
once; ``distlock_enqueue``'s handler without its advisory unlocks fails invariant 3 in
both (a row hold makes a 5 ms ``lock_timeout`` cut the enqueue); a release that reserves
nothing and notifies nobody passes (waiters poll at most DISTLOCK_POLL_MAX_INTERVAL apart,
so the idle bound still holds: it is liveness beyond what is promised).
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import connection

from distlock import acquire, break_lock, signals
from distlock.db import db_now_us
from tests.support.helpers import raw_postgres, wait_until
from tests.support.pgbouncer import ALIVE_CLASS, ENTRY_CLASS, QUEUE_CLASS
from tests.support.processes import Children

NAME = "model"
WORKER = "tests.support.model_workers:slots"
# The README's bound: DISTLOCK_POLL_MAX_INTERVAL (2 s here, not the default 1 s, so that
# the slack is a smaller share of it) plus the slack of a loaded 2-core CI machine: a
# worker's process may wait that long to be scheduled after its pause, and the test
# reads the row a sampling step (~50 ms) late. The pauses themselves are checked against
# DISTLOCK_POLL_MAX_INTERVAL exactly (no slack: each is a number the worker reports).
POLL_MAX = 2.0
SLACK = 0.5
# A SIGKILLed worker's backend ends when it notices its client is gone: at once when it
# waits for a command, within client_connection_check_interval (500 ms, set while queued:
# distlock_queue) when it waits for a lock; plus scheduling on a loaded machine.
GRACE = 5.0
STEPS = int(os.environ.get("DISTLOCK_MODEL_STEPS", "400"))
# The steps stop early past this many seconds (a loaded machine): each variant stays
# under ~40 s with its start and end. A longer run sets both.
BUDGET = float(os.environ.get("DISTLOCK_MODEL_BUDGET", "30"))
TTLS = (0.6, 1.5, 4.0)
TIMEOUTS = (0.3, 1.5, 4.0, 10.0, 10.0)  # most waits outlast a few hand-offs
CLASSES = (ALIVE_CLASS, QUEUE_CLASS, ENTRY_CLASS)
# Every session holding or awaiting a lock of the queue's classes, or owning a queue
# row; ``leak``: the lock is only the shared lock of an entry whose waiter is gone (left,
# or its session ended: a dead waiter's row stays until someone cleans up), see below.
QUEUE_HOLDERS = (
    "SELECT l.pid, l.classid::bigint = %s AND l.mode = 'ShareLock' AND l.granted "
    "AND NOT EXISTS (SELECT 1 FROM distlock_waiter w JOIN pg_stat_activity a ON a.pid = w.pid"
    " WHERE w.id %% 2147483648 = l.objid::bigint)"
    " FROM pg_locks l WHERE l.locktype = 'advisory' AND l.classid::bigint = ANY(%s::bigint[])"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " UNION ALL SELECT w.pid, false FROM distlock_waiter w WHERE EXISTS "
    "(SELECT 1 FROM pg_stat_activity a WHERE a.pid = w.pid)")
# Three defects this test found, fixed since; each flag, if True, would note the defect's
# symptom instead of failing on it (kept so a regression can be looked at without the
# test stopping at the first one):
# 1. distlock_follow kept the shared lock of the entry it waited on when PostgreSQL
#    granted it and raised the lock_timeout or cancel of the same moment (0.3 now
#    records the entry before the wait and asks pg_locks in its handler;
#    test_wakeups.py::test_a_follow_granted_and_cancelled_at_the_same_moment_keeps_no_lock).
FOLLOW_LEAK_UNFIXED = False
# 2. A cancel landing in distlock_leave's last unlocks left the session holding its queue
#    locks, and Waiter.stop() swallowed the error (it now closes the connection).
CANCEL_LEAK_UNFIXED = False
# 3. MariaDB: a KeyboardInterrupt between a CALL and reading its result sets left the
#    connection "out of sync" (2014) for every later statement (db.run_on now closes it:
#    Backend.interrupted).
MARIADB_INTERRUPT_UNFIXED = False
LOCKS = ("SELECT pid, classid, objid, objsubid, mode, granted FROM pg_locks "
         "WHERE locktype = 'advisory' AND pid = ANY(%s)")
SESSIONS = ("SELECT pid, state, wait_event_type, wait_event, backend_start, state_change, "
            "query FROM pg_stat_activity WHERE pid = ANY(%s)")

pytestmark = [pytest.mark.usefixtures("lock_db"), pytest.mark.processes]


@dataclass
class Slot:
    proc: Proc
    index: int
    state: str = "starting"  # starting, idle, waiting, holding, releasing, dead
    backend: int | None = None
    # Backends this slot's current acquire reported (it may reconnect while it waits).
    backends: set[int] = field(default_factory=set)
    since_us: int = 0  # when its current wait began, or its process was continued
    paused: bool = False  # its current acquire has been refused and waits
    cancelled: bool = False  # a SIGINT was sent to its current acquire
    token: int = 0  # the lease it holds

    @property
    def label(self) -> str:
        return f"p{self.proc.number}.{self.index}"


@dataclass
class Proc:
    number: int
    child: Any
    slots: list[Slot] = field(default_factory=list)
    stopped: bool = False
    alive: bool = True
    lock_timeout: str = ""


@dataclass
class Grant:
    token: int
    owner: str
    acquired_us: int
    expires_us: int
    slot: str
    end_us: int | None = None  # its release's database time, once released while held
    released: bool = False  # a release was sent (its outcome may not be known yet)
    release_sent_us: int = 0  # when (the release cannot have come before)
    release_known: bool = False  # its outcome was reported (not lost with its process)
    broken: bool = False


class Model:
    """The model: what each worker slot is doing as far as the test knows (from the
    commands it sent and the events it read), the grants reported, and the observer
    that checks the invariants against the database after every step."""

    def __init__(self, children: Children, variant: dict[str, Any], seed: int) -> None:
        self.children = children
        self.variant = variant
        self.rng = random.Random(seed)
        self.seed = seed
        self.postgres = connection.vendor == "postgresql"
        self.sqlite = connection.vendor == "sqlite"
        self.raw = raw_postgres() if self.postgres else None
        self.procs: list[Proc] = []
        self.grants: dict[int, Grant] = {}
        self.broken_tokens: list[int] = []
        self.free_since: dict[int, int] = {}  # row token -> when it became free, unreserved
        self.reserved_seen: dict[int, int] = {}  # row token -> last seen reserved (free)
        self.leaks: set[int] = set()  # backends seen with the known follow leak
        self.interrupted: set[int] = set()  # backends whose acquire a SIGINT ended
        self.excused: set[int] = set()  # of those, the ones that kept their queue locks
        self.known: collections.Counter[str] = collections.Counter()  # known defects seen
        self.longest = 0.0  # the longest free, unreserved wait measured (invariant 4)
        self.quiet_until = 0  # the test itself kept the lock row locked until then
        self.log: list[str] = []
        self.counts: dict[str, int] = {}
        self.numbers = 0

    # -- the observer ----------------------------------------------------------------

    def query(self, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
        if self.raw is not None:
            return list(self.raw.execute(sql, params or []))
        with connection.cursor() as cursor:
            cursor.execute(sql, params or [])
            return list(cursor.fetchall())

    def now_us(self) -> int:
        if self.raw is not None:
            return int(self.raw.execute(
                "SELECT (extract(epoch from clock_timestamp()) * 1000000)::bigint"
            ).fetchone()[0])
        return db_now_us("default")

    def row(self) -> dict[str, int | str] | None:
        columns = "owner, token, expires_us, reserved_pid, reserved_until_us"
        if not self.postgres:
            columns = "owner, token, expires_us, 0, 0"
        found = self.query(f"SELECT {columns} FROM distlock_lock WHERE name = %s", [NAME])
        if not found:
            return None
        owner, token, expires, pid, until = found[0]
        return {"owner": owner, "token": int(token), "expires_us": int(expires),
                "reserved_pid": int(pid), "reserved_until_us": int(until)}

    # -- processes -----------------------------------------------------------------

    def start(self, threads: int, lock_timeout: str = "") -> Proc:
        self.numbers += 1
        settings = {"DISTLOCK_WAKEUPS": self.variant["wakeups"],
                    "DISTLOCK_LISTENING_WAITERS": self.variant["listeners"],
                    "DISTLOCK_POLL_MAX_INTERVAL": POLL_MAX}
        child = self.children.start(WORKER, NAME, threads, settings, lock_timeout)
        proc = Proc(self.numbers, child, lock_timeout=lock_timeout)
        proc.slots = [Slot(proc, n) for n in range(threads)]
        self.procs.append(proc)
        return proc

    def live(self) -> list[Proc]:
        return [proc for proc in self.procs if proc.alive]

    def slots(self, state: str, running: bool = True) -> list[Slot]:
        return [slot for proc in self.live() for slot in proc.slots
                if slot.state == state and not (running and proc.stopped)]

    # -- events --------------------------------------------------------------------

    def drain(self, wait: float = 0.0) -> bool:
        """Apply every event the workers printed; with ``wait``, first wait up to that
        long for one. True if any came."""
        deadline = time.monotonic() + wait
        came = False
        while True:
            for proc in self.live():
                while True:
                    try:
                        event = proc.child.events.get_nowait()
                    except queue.Empty:
                        break
                    came = True
                    self.apply(proc, event)
            if came or time.monotonic() >= deadline:
                return came
            time.sleep(0.01)

    def apply(self, proc: Proc, event: dict[str, Any] | None) -> None:
        if event is None:
            raise AssertionError(f"worker p{proc.number} exited:\n"
                                 + "".join(proc.child.stderr[-30:]))
        kind = event["event"]
        if kind == "error":
            raise AssertionError(f"worker p{proc.number} failed: {event}")
        slot = proc.slots[event["slot"]]
        if event.get("backend"):
            slot.backend = event["backend"]
            if slot.state == "waiting":
                slot.backends.add(event["backend"])
        if kind == "ready":
            slot.state = "idle"
        elif kind == "pausing":
            slot.paused = True
            # Invariant 4's mechanism (README: every waiter, queued or polling, polls at
            # most DISTLOCK_POLL_MAX_INTERVAL apart, wherever it stands in the queue).
            assert event["seconds"] <= POLL_MAX, (
                f"{slot.label} pauses {event['seconds']:.3f} s between tries "
                f"(listening={event['listening']}), more than {POLL_MAX} s")
        elif kind in ("busy", "interrupted"):
            self.note(f"{slot.label} {kind} (backend {event.get('backend')})")
            slot.state = "idle"
            if kind == "interrupted" and event.get("backend"):
                self.interrupted.add(event["backend"])
            if event.get("unusable"):
                assert MARIADB_INTERRUPT_UNFIXED, (
                    f"{slot.label}'s connection was left out of sync by the interrupt")
                self.known["mariadb connection out of sync"] += 1
                self.note(f"{slot.label}: connection out of sync after the interrupt (known)")
        elif kind == "acquired":
            self.granted(slot, event)
        elif kind == "release_failed":
            self.note(f"{slot.label} release of {event['token']} failed: {event['error']}")
            assert slot.proc.lock_timeout, f"{slot.label}'s release failed: {event['error']}"
            grant = self.grants[event["token"]]
            grant.released = False
            slot.state = "holding"
        elif kind == "released":
            self.note(f"{slot.label} released {event['token']} held={event['held']}")
            grant = self.grants[event["token"]]
            grant.release_known = True
            if event["held"]:
                grant.end_us = event["released_us"]
            slot.state = "idle"

    def granted(self, slot: Slot, event: dict[str, Any]) -> None:
        token = event["token"]
        self.note(f"{slot.label} acquired {token} (backend {event.get('backend')}) at "
                  f"{event['acquired_us']}"
                  f" until {event['expires_us']}")
        # Invariant 2: no token twice, tokens rise in grant order.
        assert token not in self.grants, f"token {token} granted twice"
        grant = Grant(token, event["owner"], event["acquired_us"], event["expires_us"],
                      slot.label, broken=token in self.broken_tokens)
        for other in self.grants.values():
            earlier = other.token < token
            assert (other.acquired_us <= grant.acquired_us if earlier
                    else other.acquired_us >= grant.acquired_us), (
                f"token {token} granted at {grant.acquired_us}, token {other.token} at "
                f"{other.acquired_us}: tokens do not rise in grant order")
        self.grants[token] = grant
        # Invariant 4: the free period that this grant ended, if one was seen.
        free = self.free_since.pop(token - 1, None)
        if free is not None and not self.stalled():
            start = max(free, slot.since_us, self.quiet_until)
            idle = (grant.acquired_us - start) / 1e6
            self.longest = max(self.longest, idle)
            assert idle <= POLL_MAX + SLACK, (
                f"{slot.label} waited while the lock was free and unreserved for "
                f"{idle:.3f} s before it got token {token}")
        slot.state = "holding"
        slot.token = token

    def note(self, what: str) -> None:
        self.log.append(what)

    # -- invariants ----------------------------------------------------------------

    def check(self) -> None:
        # The row first, then the clock: a grant unexpired at the later instant was
        # unexpired when the row was read (reading the clock first, a lease that ran out
        # in between, and was taken over, looked live beside the new holder's row).
        row = self.row()
        now = self.now_us()
        # 1: at most one unexpired holder by the database clock, and it is the row's.
        live = [g for g in self.grants.values()
                if not g.released and not g.broken and g.expires_us > now]
        assert len(live) <= 1, f"two unexpired holders at {now}: {live}"
        if live:
            assert row is not None and row["token"] == live[0].token \
                and row["owner"] == live[0].owner, f"{live[0]} holds, but the row is {row}"
        # 1: each grant came after the previous one ended (release or expiry), unless the
        # previous one was broken (its holder is then fenced off by the token).
        for token, grant in self.grants.items():
            before = self.grants.get(token - 1)
            if before is None or before.broken:
                continue
            if before.end_us is not None:
                ended = before.end_us
            elif before.released and not before.release_known:
                # Not reported yet (or lost with its killed process): it was not released
                # before it was sent, and it may have expired before that.
                ended = min(before.release_sent_us, before.expires_us)
            else:
                ended = before.expires_us
            assert grant.acquired_us >= ended, (
                f"token {token} granted at {grant.acquired_us}, before token "
                f"{before.token} ended at {ended}")
        if row is not None:
            self.watch_idle(row, now)
        if self.postgres:
            self.check_queue()

    def watch_idle(self, row: dict[str, Any], now: int) -> None:
        """Invariant 4, for a free period still going on (a finished one is checked by
        the grant that ended it)."""
        held = row["owner"] and row["expires_us"] > now
        reserved = row["reserved_until_us"] > now
        if held or reserved:
            self.free_since.pop(row["token"], None)
            if reserved and not held:
                # A reservation given up (its waiter left) is cleared to 0, not ended
                # at a time the row keeps: it was unreserved only after this sample.
                self.reserved_seen[row["token"]] = now
            return
        free = max(row["expires_us"], row["reserved_until_us"],
                   self.reserved_seen.get(row["token"], 0))
        self.free_since[row["token"]] = free
        if self.stalled():
            return
        for slot in self.slots("waiting"):
            start = max(free, slot.since_us, self.quiet_until)
            idle = (now - start) / 1e6
            assert idle <= POLL_MAX + SLACK, (
                f"the lock has been free and unreserved for {idle:.3f} s while "
                f"{slot.label} waits (row {row})")

    def stalled(self) -> bool:
        """SQLite: a stopped process may be inside its write transaction (a try, a
        release), which keeps every other process from writing: the lock cannot be
        taken while any process is stopped, and the idle time counts from its
        continue or kill (``quiet_until``). (PostgreSQL and MariaDB run each operation
        in one statement on the server, which a stopped client does not hold up.)"""
        return self.sqlite and any(proc.stopped for proc in self.live())

    def offenders(self) -> set[int]:
        """Backends holding (or awaiting) a queue lock or owning a queue row that are
        not a waiting slot's."""
        found: set[int] = set()
        for pid, leak in self.query(QUEUE_HOLDERS, [ENTRY_CLASS, list(CLASSES)]):
            if leak and FOLLOW_LEAK_UNFIXED:
                if pid not in self.leaks:
                    self.leaks.add(pid)
                    self.known["follow leak"] += 1
                    self.note(f"backend {pid} kept a shared lock of a gone entry (known)")
            else:
                found.add(int(pid))
        waiting = {pid for proc in self.live() for slot in proc.slots
                   if slot.state == "waiting" for pid in slot.backends}
        offending = found - waiting
        if CANCEL_LEAK_UNFIXED:
            for pid in offending & self.interrupted:
                self.interrupted.discard(pid)
                self.excused.add(pid)
                self.known["leave cut by a cancel"] += 1
                self.note(f"backend {pid} kept its queue locks after an interrupt (known)")
            offending -= self.excused
        return offending

    def check_queue(self) -> None:
        """Invariant 3, with a grace deadline for a killed worker's backends (and for an
        event printed but not read yet)."""
        if not self.offenders():
            return

        def clean() -> bool:
            self.drain()
            return not self.offenders()

        try:
            wait_until(clean, GRACE, every=0.05)
        except AssertionError:
            pids = list(self.offenders())
            raise AssertionError(
                f"sessions not waiting hold queue locks or rows: {pids}\n"
                f"their locks: {self.query(LOCKS, [pids])}\n"
                f"their sessions: {self.query(SESSIONS, [pids])}\n"
                f"the queue: {self.query('SELECT id, pid FROM distlock_waiter')}\n"
                f"the slots: {self.slot_table()}"
            ) from None

    def slot_table(self) -> list[str]:
        return [f"{slot.label}{'(stopped)' if proc.stopped else ''}"
                f"{'(dead)' if not proc.alive else ''} {slot.state} "
                f"backend={slot.backend} waits-on={sorted(slot.backends)}"
                for proc in self.procs for slot in proc.slots]

    # -- operations ----------------------------------------------------------------

    def op_acquire(self) -> None:
        slot = self.rng.choice(self.slots("idle"))
        mode = self.rng.choices(["block", "nonblock", "zero"], [6, 1, 1])[0]
        self.send_acquire(slot, mode, self.rng.choice(TIMEOUTS))

    def send_acquire(self, slot: Slot, mode: str, timeout: float) -> None:
        order = {"command": "acquire", "slot": slot.index, "mode": mode,
                 "ttl": self.rng.choice(TTLS), "timeout": timeout}
        slot.state = "waiting"
        slot.paused = False
        slot.cancelled = False
        slot.backends = {slot.backend} if slot.backend else set()
        slot.since_us = self.now_us()
        self.note(f"{slot.label} acquire {mode} ttl={order['ttl']} timeout={timeout}")
        slot.proc.child.send(**order)

    def op_release(self) -> None:
        slot = self.rng.choice(self.slots("holding"))
        self.note(f"{slot.label} release {slot.token}")
        self.grants[slot.token].released = True
        self.grants[slot.token].release_sent_us = self.now_us()
        slot.state = "releasing"
        slot.proc.child.send("release", slot=slot.index)

    def op_cancel(self) -> None:
        slot = self.rng.choice(self.cancellable())
        slot.cancelled = True
        self.note(f"{slot.label} SIGINT")
        slot.proc.child.signal(signal.SIGINT)
        # Its outcome (interrupted, or granted just before) comes as an event.

    def cancellable(self) -> list[Slot]:
        """Main threads (SIGINT reaches only them) waiting, not interrupted yet."""
        return [s for s in self.slots("waiting") if s.index == 0 and s.paused
                and not s.cancelled]

    def op_break(self) -> None:
        broken: list[int] = []

        def seen(sender: Any, token: int, **kwargs: Any) -> None:
            broken.append(token)

        signals.lock_broken.connect(seen)
        try:
            done = break_lock(NAME)
        finally:
            signals.lock_broken.disconnect(seen)
        self.note(f"break -> {done} {broken}")
        for token in broken:
            self.broken_tokens.append(token)
            if token in self.grants:
                self.grants[token].broken = True

    def op_expire(self) -> None:
        now = self.now_us()
        live = [g for g in self.grants.values()
                if not g.released and not g.broken and now < g.expires_us]
        if not live:
            # choices() saw a lease ending soon; on a loaded machine it ended since (the
            # SQLite pass of one CI run got here with none left: min() of nothing).
            self.note("expire: the lease ended already")
            return
        grant = min(live, key=lambda g: g.expires_us)
        self.note(f"expire {grant.token} at {grant.expires_us}")

        def expired() -> bool:
            self.drain()
            self.check()
            return self.now_us() > grant.expires_us

        wait_until(expired, 10, "the lease's expiry by the database clock", every=0.05)

    def op_kill(self) -> None:
        proc = self.rng.choice(self.live())
        self.note(f"p{proc.number} SIGKILL ({[s.state for s in proc.slots]})")
        proc.child.kill()
        if self.sqlite and proc.stopped:
            self.quiet_until = max(self.quiet_until, self.now_us())
        # What it printed before it died happened.
        while (event := proc.child.events.get(timeout=10)) is not None:
            self.apply(proc, event)
        proc.alive = False
        for slot in proc.slots:
            slot.state = "dead"
        self.start(len(proc.slots), proc.lock_timeout)

    def op_stop(self) -> None:
        running = [p for p in self.live() if not p.stopped]
        # Mostly a waiter: a stopped waiter that is handed the lock is what idles it.
        waiting = [p for p in running if any(s.state == "waiting" for s in p.slots)]
        proc = self.rng.choice(waiting if waiting and self.rng.random() < 0.8 else running)
        if self.postgres and self.variant["wakeups"] and self.rng.random() < 0.6:
            # Often the head of the queue: the next release hands the lock to it, and
            # the others must take it within the bound once its window ends.
            head = self.query("SELECT pid FROM distlock_waiter WHERE name = %s "
                              "ORDER BY id LIMIT 1", [NAME])
            owner = [p for p in running for s in p.slots
                     if head and s.state == "waiting" and head[0][0] in s.backends]
            proc = owner[0] if owner else proc
        self.note(f"p{proc.number} SIGSTOP ({[s.state for s in proc.slots]})")
        proc.child.signal(signal.SIGSTOP)
        proc.stopped = True

    def op_continue(self) -> None:
        proc = self.rng.choice([p for p in self.live() if p.stopped])
        self.note(f"p{proc.number} SIGCONT")
        proc.child.signal(signal.SIGCONT)
        proc.stopped = False
        now = self.now_us()
        for slot in proc.slots:
            slot.since_us = max(slot.since_us, now)
        if self.sqlite:
            self.quiet_until = max(self.quiet_until, now)

    def op_pass(self) -> None:
        """Let time pass: until a worker's next event, or 0.5 s (watching meanwhile)."""
        deadline = time.monotonic() + 0.5
        while not (came := self.drain(wait=0.05)) and time.monotonic() < deadline:
            self.check()
        self.note(f"time passes ({'events' if came else 'none'})")

    def op_row_hold(self) -> None:
        """Hold the lock row FOR UPDATE while an idle worker with a short session
        lock_timeout starts a blocking acquire: its try and then its joining of the queue
        are cut short by its lock_timeout (issue 27, item 2), and it waits by polling."""
        slot = self.rng.choice([s for s in self.slots("idle") if s.proc.lock_timeout])
        holder = raw_postgres()
        try:
            with holder.transaction():
                holder.execute("SELECT 1 FROM distlock_lock WHERE name = %s FOR UPDATE",
                               [NAME])
                self.note("row held")
                self.send_acquire(slot, "block", self.rng.choice(TIMEOUTS[1:]))

                def refused() -> bool:
                    self.drain()
                    return slot.paused or slot.state != "waiting"

                # Its tries take at least its lock_timeout each: wait for the refusal.
                with contextlib.suppress(AssertionError):
                    wait_until(refused, 2.0, every=0.01)
        finally:
            holder.close()
        self.quiet_until = self.now_us()

    def choices(self) -> list[tuple[str, int]]:
        """The operations the state allows, with their weights."""
        now = None
        options = [("pass", 5)]
        if self.slots("idle"):
            options.append(("acquire", 8))
        if self.slots("holding"):
            options.append(("release", 4))
        if self.cancellable():
            options.append(("cancel", 1))
        if not self.stalled():
            # (On SQLite a stopped process may hold the write lock: the break would wait
            # for it, up to the busy timeout.)
            options.append(("break", 1))
        now = self.now_us()
        if any(not g.released and not g.broken and 0 < g.expires_us - now < 2_000_000
               for g in self.grants.values()):
            options.append(("expire", 1))
        if self.live():
            options.append(("kill", 1))
        if sum(p.stopped for p in self.live()) < 2 and self.slots("waiting"):
            options.append(("stop", 2))
        if any(p.stopped for p in self.live()):
            # SQLite: soon, as everyone else's writes wait for a process stopped inside
            # its transaction (up to the 30 s busy timeout, then they fail).
            options.append(("continue", 6 if self.sqlite else 1))
        if self.postgres and any(s.proc.lock_timeout for s in self.slots("idle")):
            options.append(("row_hold", 1))
        return options

    def run(self, steps: int) -> None:
        began = time.monotonic()
        wait_until(lambda: self.drain() or not self.slots("starting", running=False),
                   60, "the workers started", every=0.05)
        for step in range(steps):
            if time.monotonic() - began > BUDGET:
                self.note(f"budget spent after {step} steps")
                break
            options = self.choices()
            name = self.rng.choices([o for o, _ in options], [w for _, w in options])[0]
            self.counts[name] = self.counts.get(name, 0) + 1
            self.note(f"step {step}: {name}")
            getattr(self, f"op_{name}")()
            self.drain()
            self.check()

    def close(self) -> None:
        for proc in self.live():
            if proc.stopped:
                proc.child.signal(signal.SIGCONT)
        if self.raw is not None:
            self.raw.close()


VARIANTS = [
    pytest.param({"wakeups": True, "listeners": 8, "lock_timeouts": ["", "", "5ms", "", ""]},
                 id="wakeups-listen8", marks=pytest.mark.no_pooler(
                     "DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")),
    pytest.param({"wakeups": True, "listeners": 1, "lock_timeouts": ["", "5ms", "5ms", "", ""]},
                 id="wakeups-chain", marks=pytest.mark.no_pooler(
                     "DISTLOCK_WAKEUPS = True: the waiters queue on sessions of their own")),
    pytest.param({"wakeups": False, "listeners": 8, "lock_timeouts": ["", "", "", "", ""]},
                 id="polling"),
]


def test_the_waiting_machinery_keeps_its_invariants(children, variant):
    seed = int(os.environ.get("DISTLOCK_MODEL_SEED", random.randrange(2**32)))
    model = Model(children, variant, seed)
    started = time.monotonic()
    try:
        # The row exists from the start (the row hold needs it): token 1, released.
        first = acquire(NAME, ttl=30)
        assert first is not None and first.release() is True
        for number, lock_timeout in enumerate(variant["lock_timeouts"]):
            model.start(2 if number == 0 else 1,
                        lock_timeout if model.postgres else "")
        model.run(STEPS)
    except Exception as exc:
        print("the whole run:", *model.log, sep="\n")
        tail = "\n".join(model.log[-40:])
        what = exc if isinstance(exc, AssertionError) else repr(exc)
        raise AssertionError(
            f"{what}\n[seed {seed}: replay with DISTLOCK_MODEL_SEED={seed}, "
            f"variant {variant}]\nthe last steps:\n{tail}"
        ) from (None if isinstance(exc, AssertionError) else exc)
    finally:
        model.close()
    if os.environ.get("DISTLOCK_MODEL_LOG"):
        print("the whole run:", *model.log, sep="\n")
    print(f"seed {seed}: {sum(model.counts.values())} steps, {len(model.grants)} grants, "
          f"known defects {dict(model.known)}, longest idle {model.longest:.2f} s, "
          f"{time.monotonic() - started:.1f} s, {model.counts}")


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param["wakeups"] and connection.vendor != "postgresql":
        pytest.skip("wake-ups are PostgreSQL's; elsewhere waiting is polling")
    return request.param
