"""Waking blocking acquires when the lock is freed: LISTEN/NOTIFY on PostgreSQL.

A blocking ``acquire()`` that is refused waits before its next try. On PostgreSQL (with
psycopg 3 and ``DISTLOCK_WAKEUPS`` on) it first joins the name's queue of waiters on its
own connection to the lock's database (``distlock_enqueue``, backends/postgresql_functions.py: a
row in ``distlock_waiter``, an advisory lock on the row's entry held until it leaves,
advisory locks that say someone is queued and that this session is alive), tries once
more at once if the lock looked free (it may have been freed before it queued), and then
waits for its hand-off *or* the usual back-off pause, whichever comes first. A release or
break with waiters reserves the freed lock for the oldest live waiter for a short grant
window and notifies only that one; everyone else's tries are refused until it takes the
grant or the window ends. So one waiter is woken per release, served in the order they
queued, and the releasing process cannot win it back; the polling stays as the fallback:
for expiry (nobody notifies when a holder dies) and for anything that went wrong with a
notification.

A waiter that finds fewer than ``DISTLOCK_LISTENING_WAITERS`` (8) queued ahead of it, or
nobody live, LISTENs. Each other one waits on the entry lock of the waiter just ahead
(``distlock_follow``), which PostgreSQL's lock manager grants, waking that one session,
when the waiter ahead leaves the queue (granted, gave up, or its session ended); it then
looks again, and becomes the head or waits behind the next one. PostgreSQL signals every
listening backend of the database on each NOTIFY, so with every waiter listening a
hand-off to one of 64 cost the CPU of 64 (docs/performance.md, "The first waiters
listen": 22 % more server CPU per grant than the chain); with only the head listening
each waiter behind it pays a statement more per grant, which a short queue need not. So
a queue of up to 8 runs with everyone listening, and a longer one turns into the chain
as it moves.

Elsewhere (MariaDB, SQLite, psycopg 2, wake-ups off) waiting is a plain sleep.

The threads of one process waiting for one name queue up (:func:`queue_for`): only the
first in the queue listens and tries; the others wait in the process until it got the
lock or gave up, and the next one takes its place. Without the queue every waiting thread
listened on its own connection, so each release woke all of them and they raced with a
try each (50 threads waiting on one PostgreSQL name ran at 0.20x of 8; docs/performance.md
"Waiting in turns"). The queue also makes the hand-over first come, first served among a
process's threads.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from django.db import DatabaseError, connections

from distlock import db
from distlock.backends import backend_for
from distlock.backends.results import Busy
from distlock.conf import conf


class Waiter:
    """The waiting of one blocking acquire of ``name`` on database ``alias``."""

    def __init__(self, alias: str, name: str, freed: threading.Event | None = None) -> None:
        self.alias = alias
        self.freed = freed
        self.name = name
        self.connection = connections[alias]
        self.raw: Any = None
        self.backend = backend_for(self.connection)
        # The queue entry a hand-off names; "" once the hand-off came (the entry is gone).
        self.queued = ""
        # The entry whose advisory lock this session holds until it leaves (0: none).
        self.entry = 0
        # It LISTENs (fewer than `listeners` were queued ahead of it, or nobody live is
        # ahead any more); the others wait behind the one just ahead.
        self.head = False
        self.listeners = int(conf.LISTENING_WAITERS)
        # Did the lock look free once queued (freed before the entry could be seen)?
        self.free = False
        if conf.WAKEUPS and self.backend.supports_wakeups():
            try:
                self.free = self._queue(True)
            except BaseException:
                # An interrupt (Ctrl-C, a soft time limit) may land after distlock_enqueue
                # committed and before its entry is known here: the session would keep
                # the queue's session-level locks and its place, and no caller holds this
                # Waiter to stop it. Only the session's end gives them back for sure.
                with contextlib.suppress(Exception):
                    self.connection.close()
                raise
            if self.entry:
                self.raw = self.connection.connection

    def _queue(self, first: bool) -> bool:
        """Join the queue (again, when not ``first``); True if the lock is worth a try now.

        The session's ``lock_timeout`` or ``statement_timeout`` may cut the call short:
        then the database function has given back everything it took
        and says so with entry 0, and this waiter polls from here on, as a busy try does.
        On a second call that leaves what the first one took: its previous entry is
        given up either way."""
        try:
            # (How many are ahead is not needed: every queued waiter polls alike.)
            entry, free, _, self.head = db.run(
                self.alias, "enqueue", self.name, first, self.entry, self.listeners
            )
        except BaseException:
            if not first:
                self.entry = 0
                self.queued = ""
            raise
        self.entry = int(entry)
        self.queued = str(entry)
        if not self.entry:
            if not first:
                self.stop()
            return True
        return bool(free)

    def queued_pause(self, busy: Busy, left: float | None) -> float:
        """How long a queued waiter waits before its next try after ``busy``.

        A release hands the lock over and says so, and a waiter leaving the queue wakes
        the one behind it: the poll is left only for what nobody announces — the
        holder's expiry (it still wakes just after it), a hand-off whose waiter never
        came (its window ends unannounced) and a waiter ahead that stopped (SIGSTOP)
        while it held its place. Every queued waiter polls at most
        DISTLOCK_POLL_MAX_INTERVAL apart (jittered down to half of it), wherever it is in
        the queue: so a waiter that never comes for its hand-off keeps the lock idle for
        at most the window plus that interval. (Until 0.3 a waiter behind n others
        polled n + 1 times as seldom, and a stopped waiter left the lock idle for 10-17 s
        with 20 queued ahead: issue 27, item 3. The polls of a queue of 64 are 64
        refused tries a second, a few milliseconds of server time.)
        """
        pause = float(conf.POLL_MAX_INTERVAL) * random.uniform(0.5, 1.0)
        if busy.remaining_us is not None:
            pause = min(pause, busy.remaining_us / 1e6 + 0.001)
        if left is not None:
            pause = min(pause, left)
        return max(pause, 0.0)

    @property
    def listening(self) -> bool:
        """True while this waiter is queued on its session (a reconnect drops the LISTEN,
        the advisory locks and with them its place in the queue)."""
        return self.raw is not None and self.raw is self.connection.connection

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``; return early when the lock is handed over, or worth a
        try."""
        if not self.listening:
            if self.freed is None:
                time.sleep(seconds)
            else:
                self.freed.wait(seconds)
                self.freed.clear()
            return
        if not self.queued and self._queue(False):
            # Handed the lock and still refused (the window ran out before the try): to
            # the back of the queue again, or at once to a try if it is free by now.
            return
        deadline = time.monotonic() + seconds
        while not self.head:
            if self._follow(deadline - time.monotonic()):
                return
        left = deadline - time.monotonic()
        if left > 0 and self.backend.wait_for_handoff(self.connection, left, self.queued):
            self.queued = ""

    def _follow(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the waiter ahead to leave the queue (it blocks on
        that waiter's entry lock, so a long queue has one session listening, and at most
        ``listeners`` while it was short). True: go and try now (the time is up, or this
        waiter became the head and the lock looks free or was handed to it); False: look
        again, the one ahead left (above READ COMMITTED; in it, distlock_follow looks again
        itself)."""
        if seconds <= 0:
            return True
        wait_ms = min(max(math.ceil(seconds * 1000), 1), _MAX_WAIT_MS)
        try:
            status, free, _ = db.run(self.alias, "follow", self.name, self.entry, wait_ms)
        except DatabaseError as exc:
            # The caller's own statement_timeout ended the wait first: as if it ran out.
            if not self.backend.lock_wait_cut_short(exc):
                raise
            return True
        if status == "moved":
            return False
        if status == "waited":
            return True
        self.head = True
        if status == "handed":
            # Handed the lock while it waited behind another: its entry is gone.
            self.queued = ""
            return True
        return bool(free)

    def stop(self) -> None:
        """Leave the queue (the acquire got the lock, gave up or failed).

        If leaving fails — the connection broke, or a cancel landed in it (Ctrl-C, or
        psycopg's cancel of the statement before arriving late) — the session may still
        hold the queue's session-level locks, which only its end gives back for sure: the
        connection is closed (Django opens a new one for the next query). A broken
        connection dropped them already; its error is not raised, anything else is."""
        if self.listening:
            try:
                db.run(self.alias, "leave", self.name, self.entry)
            except BaseException as exc:
                # Not left to db.run_on's Backend.interrupted: that judges what one
                # statement may have left (and keeps a PostgreSQL session psycopg brought
                # back to idle after Ctrl-C), and is not called for a DatabaseError. The
                # queue's locks are the session's, outlive any statement, and only this
                # leave gives them back: after it failed in any way, only the session's
                # end does.
                with contextlib.suppress(Exception):
                    self.connection.close()
                if not isinstance(exc, DatabaseError):
                    raise
        self.raw = None


# lock_timeout's largest value (milliseconds, a 32-bit integer).
_MAX_WAIT_MS = 2**31 - 1


class _Queue:
    """The threads of this process waiting for one name, in the order they came."""

    __slots__ = ("freed", "turns")

    def __init__(self) -> None:
        self.turns: deque[threading.Event] = deque()
        # Set by a release or break of the name in this process (see poke()): the first
        # waiter, when it polls, is then not left to sleep out its pause.
        self.freed = threading.Event()


class Turn:
    """What :func:`queue_for` yields once a thread is first: whether it was first on
    arrival (nothing happened since its last try), and the event a release in this
    process sets."""

    __slots__ = ("arrived_first", "freed")

    def __init__(self, arrived_first: bool, freed: threading.Event) -> None:
        self.arrived_first = arrived_first
        self.freed = freed


_queues: dict[tuple[str, str], _Queue] = {}
_queues_lock = threading.Lock()


def _forget_queues() -> None:
    """In a child made by fork (Celery's prefork pool, gunicorn --preload): the queued
    threads were not copied, so their queues would keep the child's acquires waiting for
    turns that never come, and the mutex may have been copied held."""
    global _queues_lock
    _queues.clear()
    _queues_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_queues)


def has_queue(alias: str, name: str) -> bool:
    """Do threads of this process queue for ``name``? (A hint, read without the lock: a
    blocking acquire then joins the queue rather than trying ahead of it.)"""
    return (alias, name) in _queues


@contextlib.contextmanager
def queue_for(alias: str, name: str, deadline: float | None) -> Iterator[Turn | None]:
    """Wait for this thread's turn to try ``name``: yields a :class:`Turn` once it is first
    in the queue, None if ``deadline``
    (monotonic) passed first. Leaving the block gives the turn to the next thread,
    whatever happened inside.
    """
    key = (alias, name)
    mine = threading.Event()
    with _queues_lock:
        queue = _queues.get(key)
        if queue is None:
            queue = _queues[key] = _Queue()
        queue.turns.append(mine)
        first = queue.turns[0] is mine
        if first:
            mine.set()
    try:
        if not first:
            if deadline is None:
                mine.wait()
            else:
                mine.wait(max(deadline - time.monotonic(), 0.0))
        yield Turn(first, queue.freed) if mine.is_set() else None
    finally:
        with _queues_lock:
            queue.turns.remove(mine)
            if queue.turns:
                # A thread that timed out just as its turn came is first here too: the
                # turn passes on either way.
                queue.turns[0].set()
            elif _queues.get(key) is queue:
                del _queues[key]


def poke(alias: str, name: str) -> None:
    """This process freed ``name``: cut short the pause of its first waiter here, if any."""
    queue = _queues.get((alias, name))
    if queue is not None:
        queue.freed.set()


def queued(alias: str, name: str) -> int:
    """How many threads of this process wait for ``name`` (the first one included)."""
    with _queues_lock:
        queue = _queues.get((alias, name))
        return 0 if queue is None else len(queue.turns)
