"""Helpers shared by the test modules: waiting on conditions, running under a deadline.

One definition each: a helper two test modules need lives here (a fixture two need lives
in tests/conftest.py). Child processes import it before django.setup() (for us()), so
what needs the app registry is imported inside the function that uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import connections

from distlock.times import EPOCH

if TYPE_CHECKING:
    from distlock import Lease

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], timeout: float = 10.0, what: str = "", every: float = 0.01
) -> T:
    """Poll ``condition`` every ``every`` seconds until it returns something true; return it.

    Fails the test (AssertionError) after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout} s")
        time.sleep(every)
    return value


def wait_expired(name: str, timeout: float = 10.0) -> None:
    """Wait until lock ``name``'s lease has run out by the database clock (not the host's)."""
    from distlock.db import db_now_us
    from distlock.models import Lock

    expires = Lock.objects.get(name=name).expires_us
    wait_until(lambda: db_now_us("default") > expires, timeout,
               "the lease's expiry by the database clock")


def expired_lock(name: str, holder: str = "sleepy") -> Lease:
    """A lease whose ttl has run out by the database clock, not taken over."""
    from distlock import acquire

    lease = acquire(name, ttl=0.05, holder=holder)
    wait_expired(name)
    return lease


def raw_postgres(**override: Any) -> Any:
    """A PostgreSQL session outside Django (autocommit), to watch waiters and play one by
    hand: the test database's connection parameters (``override``: others, e.g. another
    ``dbname``), without Django's cursor factory."""
    import psycopg

    params = connections["default"].get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**{**params, **override}, autocommit=True)


def us(moment: datetime | None) -> int | None:
    """A lease's datetime as database microseconds (the unit of the lock row's columns)."""
    if moment is None:
        return None
    delta = moment - EPOCH
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def kill_other_sessions(alias: str = "default") -> None:
    """End every other session on the test database (unblocks a hung statement)."""
    connection = connections[alias]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        elif connection.vendor == "mysql":
            cursor.execute(
                "SELECT id FROM information_schema.processlist "
                "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
            )
            for (session,) in cursor.fetchall():
                cursor.execute(f"KILL {int(session)}")


def start_thread(work: Callable[[], object]) -> threading.Thread:
    """Start ``work`` in a thread of its own, which closes its database connections when
    it ends; the caller joins it."""

    def target() -> None:
        try:
            work()
        finally:
            connections.close_all()

    thread = threading.Thread(target=target)
    thread.start()
    return thread


def waiting_in(thread: threading.Thread, function: Callable[..., object]) -> bool:
    """True while ``thread`` is blocked in a threading wait (an Event's or a Condition's)
    reached from ``function``: "the loop is asleep in ``Term.sleep``" as a condition to
    wait on, where a flag set just before the call would leave the race open."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return False
    code = getattr(function, "__code__", None)
    blocked = frame.f_code.co_name == "wait" and frame.f_code.co_filename == threading.__file__
    while frame is not None:
        if frame.f_code is code:
            return blocked
        frame = frame.f_back
    return False


def run_with_deadline(body: Callable[[], T], seconds: float = 20.0) -> T:
    """Run ``body`` in a thread of its own (with its own connections); fail if it hangs.

    A body still running after ``seconds`` is stopped by ending its database sessions
    (SQLite: its busy timeout ends it), and the test fails with "did not finish".
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = body()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=target, name="deadline-body", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        kill_other_sessions()
        thread.join(60)
        raise AssertionError(f"did not finish within {seconds} s (a hang)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def run_async(make: Callable[[], Awaitable[T]], seconds: float = 60.0) -> T:
    """Run the coroutine ``make()`` in a new event loop, failing it after ``seconds``.

    Django's sync layer runs the coroutine's database work in a thread of its own
    (asgiref's thread-sensitive executor): its connections are closed before this
    returns, as a request's are at its end. So is the loop's LISTEN connection of
    async wake-ups, also when ``make()`` fails with tasks still waiting
    (:func:`_settle_the_loop`).
    """

    async def main() -> T:
        try:
            async with asyncio.timeout(seconds):
                return await make()
        finally:
            try:
                async with asyncio.timeout(30):
                    await _settle_the_loop()
            finally:
                await sync_to_async(connections.close_all)()

    return asyncio.run(main())


async def _settle_the_loop() -> None:
    """End the tasks a test's coroutine left behind, and what their ends start.

    asyncio.run cancels the tasks left at its end, but not the tasks their cancellation
    starts: a waiter that leaves unregisters its name in a task of the loop's wake-up
    listener, which closes the LISTEN connection when no name is left. Left pending, that
    connection stays open after the loop is gone (a session that keeps the test database
    from being dropped, a LISTEN that makes releases notify). So: cancel the leftovers and
    wait for them, then for the listener's own tasks, then close a connection still open.
    """
    from distlock.waiting import listener

    current = asyncio.current_task()
    leftovers = [task for task in asyncio.all_tasks() if task is not current]
    for task in leftovers:
        task.cancel()
    await asyncio.gather(*leftovers, return_exceptions=True)
    for per_alias in listener._listeners.get(asyncio.get_running_loop(), {}).values():
        while per_alias.tasks:
            await asyncio.gather(*per_alias.tasks, return_exceptions=True)
        if per_alias.raw is not None:
            per_alias._unwatch()
            raw, per_alias.raw = per_alias.raw, None
            await raw.close()


def released(name: str, timeout: float = 10.0) -> Any:
    """Lock ``name``'s row once it is free (a task records its end just before releasing)."""
    from distlock.models import Lock

    return wait_until(lambda: (row := Lock.objects.get(name=name)).is_free and row, timeout,
                      f"{name} released")


def assert_freed_by_release(name: str, start: dict[str, Any]) -> None:
    """A task run that reported ``start`` (its grant) released lock ``name`` as it ended,
    long before its ttl, and the next grant is the next token."""
    from distlock import acquire

    row = released(name)
    assert row.token == start["token"]
    # Freed by a release (it records the release time), 30 s before the ttl would have.
    assert row.expires_us < start["expires_us"] - 20_000_000
    following = acquire(name, ttl=30, blocking=False)
    assert following is not None and following.token == start["token"] + 1
    assert following.release() is True


class RowHolder:
    """Another connection holding lock ``name``'s row (on SQLite: the write lock) in an open
    transaction, from entering the block until :meth:`let_go` (or the block's end).

    A lock operation on the name meanwhile waits in the database: ``SELECT … FOR UPDATE``
    on PostgreSQL and MariaDB, a ``BEGIN IMMEDIATE`` write transaction on SQLite (whose
    busy timeout, 30 s in the test settings, outlasts any test).
    """

    def __init__(self, name: str, hold_for: float = 60.0) -> None:
        self.name = name
        self.hold_for = hold_for
        self.holding = threading.Event()
        self.go_on = threading.Event()
        self.thread: threading.Thread | None = None

    def _hold(self) -> None:
        from django.db import transaction

        from distlock.models import Lock

        with transaction.atomic():
            list(Lock.objects.select_for_update().filter(name=self.name))
            self.holding.set()
            self.go_on.wait(self.hold_for)

    def __enter__(self) -> RowHolder:
        self.thread = start_thread(self._hold)
        if not self.holding.wait(10):
            self.let_go()
            raise AssertionError(f"the row of {self.name!r} was not locked within 10 s")
        return self

    def let_go(self) -> None:
        """End the holding transaction (the waiting operation goes on)."""
        self.go_on.set()

    def __exit__(self, *exc_info: object) -> None:
        self.let_go()
        if self.thread is not None:
            self.thread.join(30)


def lock_waits(alias: str = "default") -> int:
    """How many sessions of the test database wait for a row lock now, sessions of the
    server's other databases not counted. PostgreSQL: waiting on a lock by
    pg_stat_activity. MariaDB: running a locking read (``FOR UPDATE``, as distlock's
    procedures do first) — information_schema.innodb_trx misses a session that waits in
    the optimizer's read of a unique key ("Statistics"), so the process list is read.
    SQLite: always 0 (its waits are in the client's busy handler, invisible to others)."""
    connection = connections[alias]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
        elif connection.vendor == "mysql":
            cursor.execute(
                "SELECT COUNT(*) FROM information_schema.processlist WHERE db = DATABASE() "
                "AND id <> CONNECTION_ID() AND command = 'Query' AND info LIKE %s",
                ["%FOR UPDATE%"],
            )
        else:
            return 0
        return int(cursor.fetchone()[0])


async def off_loop(work: Callable[[], T]) -> T:
    """Run the sync ``work`` in a thread of its own connections (closed after it), neither
    on the loop nor in Django's sync layer (which may be busy with the operation under
    test)."""

    def target() -> T:
        try:
            return work()
        finally:
            connections.close_all()

    return await asyncio.to_thread(target)


@contextlib.asynccontextmanager
async def sync_layer_statements() -> AsyncIterator[list[str]]:
    """The SQL that Django's sync layer (``sync_to_async``, thread-sensitive: where the async
    API runs its database operations) sends while the block runs, each recorded as it
    starts, before the database answers."""
    sent: list[str] = []

    def watch(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append(sql)
        return execute(sql, params, many, context)

    def add() -> None:
        connections["default"].execute_wrappers.append(watch)

    def remove() -> None:
        connections["default"].execute_wrappers.remove(watch)

    await sync_to_async(add)()
    try:
        yield sent
    finally:
        await sync_to_async(remove)()


async def wait_for(condition: Callable[[], object], timeout: float = 10.0, what: str = "") -> None:
    """Await until ``condition()`` is true, looking every few milliseconds without blocking
    the loop; fail the test (AssertionError) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout} s")
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def raise_in_main_thread(
    error: type[BaseException], when: Callable[[], object], timeout: float = 10.0
) -> Iterator[None]:
    """While the block runs, raise ``error`` in the main thread once ``when()`` is true,
    from a SIGUSR1 handler: the way Celery's soft time limit (SoftTimeLimitExceeded) and
    Ctrl-C (KeyboardInterrupt) reach code, at a moment a condition picks, not a timer.

    ``when`` is asked in a thread of its own, with its own connections (closed after):
    e.g. "the main thread's statement waits for a row lock". Fails the test if it is
    not true within ``timeout`` seconds. Only the main thread runs signal handlers.
    """
    import signal

    def handler(signum: int, frame: object) -> None:
        raise error()

    failed: list[BaseException] = []
    main = threading.main_thread().ident
    assert main == threading.get_ident(), "signal handlers run in the main thread only"

    def watch() -> None:
        try:
            wait_until(when, timeout, f"the moment to raise {error.__name__}")
            signal.pthread_kill(main, signal.SIGUSR1)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            failed.append(exc)

    previous = signal.signal(signal.SIGUSR1, handler)
    watcher = start_thread(watch)
    try:
        yield
    finally:
        watcher.join(timeout + 30)
        signal.signal(signal.SIGUSR1, previous)
    if failed:
        raise failed[0]


class TryGate:
    """Holds one refused try of the async API in Django's sync layer, after the database
    answered and before the coroutine sees the answer, until :meth:`let_go`.

    The async acquire's tries (``distlock.core.async_locks._attempt``) are counted as the
    database refuses them; the ``hold``-th one is held. Meanwhile the event loop runs on
    (the coroutine awaits its try), so a test can release the lock from another thread
    exactly in the gap between a refused try and what the waiter does next.
    """

    def __init__(self, hold: int, timeout: float = 30.0) -> None:
        self.hold = hold
        self.timeout = timeout
        self.refused = 0
        self.holding = threading.Event()
        self.go_on = threading.Event()

    def wrap(self, attempt: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``attempt`` with the gate after it (it runs in the sync layer's thread)."""
        from distlock.backends.results import Busy

        def gated(request: Any) -> Any:
            result = attempt(request)
            if isinstance(result, Busy):
                self.refused += 1
                if self.refused == self.hold:
                    self.holding.set()
                    # Bounded: a test that fails meanwhile must not leave the thread stuck.
                    self.go_on.wait(self.timeout)
            return result

        return gated

    def let_go(self) -> None:
        """Let the held try return its refusal to the coroutine."""
        self.go_on.set()


@contextlib.contextmanager
def sync_layer_tries(hold: int) -> Iterator[TryGate]:
    """While the block runs, the async API's ``hold``-th refused try is held by a
    :class:`TryGate` (let go at the latest when the block ends)."""
    from distlock.core import async_locks

    gate = TryGate(hold)
    original = async_locks._attempt
    async_locks._attempt = gate.wrap(original)
    try:
        yield gate
    finally:
        gate.let_go()
        async_locks._attempt = original


@contextlib.contextmanager
def after_each_dispatch(then: Callable[[str], object] | None = None) -> Iterator[list[str]]:
    """While the block runs, record each wake-up the async LISTEN connections dispatch
    (:meth:`distlock.waiting.listener._Listener.dispatch`: a release's NOTIFY, or a
    wake-up passed on), by its channel, and call ``then(channel)`` right after it, in the
    same round of the event loop: nothing else runs between the wake-up and ``then``."""
    from distlock.waiting import listener

    seen: list[str] = []
    original = listener._Listener.dispatch

    def dispatch(self: listener._Listener, name_channel: str) -> None:
        original(self, name_channel)
        seen.append(name_channel)
        if then is not None:
            then(name_channel)

    listener._Listener.dispatch = dispatch
    try:
        yield seen
    finally:
        listener._Listener.dispatch = original
