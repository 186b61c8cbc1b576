"""Waking waiting coroutines when a lock is freed: one LISTEN connection per event loop.

The sync waiter (:mod:`distlock.waiting.queue`) listens on the acquiring thread's own
connection and blocks in psycopg's ``notifies()``. A coroutine must not block, and 200
coroutines waiting in one process must not cost 200 connections or threads. So each event
loop keeps one psycopg ``AsyncConnection`` per lock database, shared by all its waiters:

- the first waiter of a name registers it there (``distlock_listen``: LISTEN on the
  lock's channel and the shared advisory lock that tells releasers someone waits), the
  last one to leave unregisters it (``distlock_unlisten``), and the connection is closed
  when no name is left, so an idle loop holds no connection;
- the socket is watched with ``loop.add_reader``; between commands nothing reads it but
  that callback, and during a command psycopg hands the notifications it meets to a
  notify handler. Either way they reach :meth:`_Listener.dispatch`;
- a notification wakes *one* waiter of the name, the one waiting longest, not all of
  them: only one can get the lock, and the others would only race it to the database.
  The woken waiter that does not get it waits again; the polling pause stays the
  fallback for everything a notification does not announce (expiry, a lost message).

When anything fails (no psycopg 3, a connection refused or broken) waiters fall back to
sleeping their back-off pause, as the sync waiter does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import weakref
from collections import deque
from typing import Any

from django.db import connections

from distlock.backends import backend_for
from distlock.conf import conf

logger = logging.getLogger("distlock")

# Keys of Django's connection parameters that belong to its sync psycopg connection only.
_SYNC_ONLY_PARAMS = ("cursor_factory", "context")


def channel(name: str) -> str:
    """The NOTIFY channel of lock ``name``: ``distlock_channel()``
    (distlock/backends/postgresql_functions.py)."""
    return "distlock_" + hashlib.md5(name.encode()).hexdigest()[:24]  # noqa: S324 - a name, not a secret


class _Channel:
    """The waiters of one name in this loop, oldest first."""

    def __init__(self, listener: _Listener, name: str) -> None:
        self.name = name
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.members = 0
        # A notification that came while nobody was waiting (all were trying): the next
        # one to wait takes it at once instead of sleeping through it.
        self.pending = False
        self.registered: asyncio.Future[bool] = listener.loop.create_future()


class _Listener:
    """The LISTEN connection of one event loop to one database."""

    def __init__(self, loop: asyncio.AbstractEventLoop, alias: str) -> None:
        self.loop = loop
        self.alias = alias
        self.channels: dict[str, _Channel] = {}
        self.raw: Any = None
        self.commands = asyncio.Lock()
        self.watching = False
        self.tasks: set[asyncio.Task[Any]] = set()

    async def _connect(self) -> Any:
        import psycopg

        params = dict(connections[self.alias].get_connection_params())
        for key in _SYNC_ONLY_PARAMS:
            params.pop(key, None)
        raw = await psycopg.AsyncConnection.connect(autocommit=True, **params)
        raw.add_notify_handler(lambda notify: self.dispatch(notify.channel))
        return raw

    def _watch(self) -> None:
        if self.raw is not None and not self.watching:
            self.loop.add_reader(self.raw.fileno(), self._readable)
            self.watching = True

    def _unwatch(self) -> None:
        if self.watching:
            self.loop.remove_reader(self.raw.fileno())
            self.watching = False

    def _readable(self) -> None:
        pgconn = self.raw.pgconn
        try:
            pgconn.consume_input()
        except Exception:  # noqa: BLE001 - a broken connection: waiters fall back to polling
            self._broken()
            return
        while (notify := pgconn.notifies()) is not None:
            self.dispatch(notify.relname.decode())

    def _broken(self) -> None:
        logger.warning("distlock's async wake-up connection to %r broke", self.alias)
        self._unwatch()
        raw, self.raw = self.raw, None
        for state in self.channels.values():
            if not state.registered.done():
                state.registered.set_result(False)
            for future in state.waiting:
                if not future.done():
                    future.set_result(None)
        self.channels.clear()
        if raw is not None:
            self._spawn(raw.close())

    def _spawn(self, coroutine: Any) -> None:
        task = self.loop.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def dispatch(self, name_channel: str) -> None:
        """Wake the longest-waiting waiter of the channel's name."""
        for state in self.channels.values():
            if channel(state.name) == name_channel:
                while state.waiting:
                    future = state.waiting.popleft()
                    if not future.done():
                        future.set_result(None)
                        return
                state.pending = True
                return

    async def _command(self, sql: str, name: str) -> bool:
        async with self.commands:
            try:
                if self.raw is None:
                    self.raw = await self._connect()
                self._unwatch()
                await self.raw.execute(sql, [name])
                # A notification already read by the command's own wait went to the
                # notify handler; anything buffered since is picked up here.
                self._watch()
                self._readable()
                return self.raw is not None
            except Exception:  # noqa: BLE001 - no wake-ups: waiters poll, as without them
                logger.warning(
                    "distlock's async wake-ups on %r failed; waiters poll", self.alias,
                    exc_info=True,
                )
                if self.raw is not None:
                    self._broken()
                return False

    async def join(self, name: str) -> _Channel | None:
        """Count one more waiter of ``name``; None if wake-ups cannot be had.

        The LISTEN runs as a task of its own: a waiter cancelled while it is in flight
        leaves, and the others (and the connection) are not disturbed.
        """
        state = self.channels.get(name)
        if state is None:
            state = self.channels[name] = _Channel(self, name)
            registered = state.registered

            def settle(task: asyncio.Task[bool]) -> None:
                ok = not task.cancelled() and task.exception() is None and task.result()
                if not registered.done():
                    registered.set_result(bool(ok))

            task = self.loop.create_task(self._command("SELECT distlock_listen(%s)", name))
            task.add_done_callback(settle)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        state.members += 1
        try:
            ok = await asyncio.shield(state.registered)
        except asyncio.CancelledError:
            self.leave(state)
            raise
        if not ok:
            self.leave(state)
            return None
        return state

    def leave(self, state: _Channel) -> None:
        """Count one waiter less; the last one unregisters the name (in the background)."""
        state.members -= 1
        if state.members > 0 or self.channels.get(state.name) is not state:
            return
        del self.channels[state.name]

        def unregister(registered: asyncio.Future[bool]) -> None:
            if not registered.cancelled() and registered.result():
                self._spawn(self._unregister(state.name))

        # At once if registered, so the UNLISTEN is queued before a later waiter's LISTEN;
        # still registering (the last waiter was cancelled meanwhile): once it is done.
        if state.registered.done():
            unregister(state.registered)
        else:
            state.registered.add_done_callback(unregister)

    async def _unregister(self, name: str) -> None:
        try:
            if self.raw is not None:
                await self._command("SELECT distlock_unlisten(%s)", name)
        finally:
            # Nothing left to listen for: an idle loop keeps no connection open.
            if not self.channels and self.raw is not None:
                async with self.commands:
                    if not self.channels and self.raw is not None:
                        self._unwatch()
                        raw, self.raw = self.raw, None
                        await raw.close()


_listeners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _Listener]] = (
    weakref.WeakKeyDictionary()
)


class AsyncWaiter:
    """The waiting of one coroutine's blocking acquire of ``name`` on database ``alias``."""

    def __init__(self, alias: str, name: str) -> None:
        self.alias = alias
        self.name = name
        self.state: _Channel | None = None
        self.listener: _Listener | None = None

    @property
    def listening(self) -> bool:
        """True while a release can wake this waiter."""
        return self.state is not None and self.listener is not None and (
            self.listener.raw is not None
        )

    async def start(self) -> None:
        """Register for wake-ups where the backend has them and they are on."""
        if not (conf.WAKEUPS and backend_for(connections[self.alias]).supports_wakeups()):
            return
        loop = asyncio.get_running_loop()
        per_alias = _listeners.setdefault(loop, {})
        listener = per_alias.get(self.alias)
        if listener is None:
            listener = per_alias[self.alias] = _Listener(loop, self.alias)
        self.listener = listener
        self.state = await listener.join(self.name)

    async def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``; return early when the lock's release is announced."""
        state = self.state
        if not self.listening or state is None:
            await asyncio.sleep(seconds)
            return
        if state.pending:
            state.pending = False
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        state.waiting.append(future)
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns the result, swallowing the
            # cancellation, when the future is set (a wake-up) as the task is cancelled.
            # asyncio.wait neither swallows a cancellation nor cancels the future.
            await asyncio.wait((future,), timeout=seconds)
        except asyncio.CancelledError:
            # Woken and cancelled at once: pass the wake-up on, or it is lost for all.
            if future.done() and self.listener is not None:
                self.listener.dispatch(channel(state.name))
            raise
        finally:
            if not future.done():
                future.cancel()
            with contextlib.suppress(ValueError):  # taken by dispatch()
                state.waiting.remove(future)

    def stop(self) -> None:
        """Stop waiting (the acquire got the lock, gave up, failed or was cancelled)."""
        state, self.state = self.state, None
        if state is not None and self.listener is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closing
                self.listener.leave(state)
