"""The ways of running lock operations that benchmarks/async_api.py compares, one class each.

Every design makes one *cycle*: take the lock (non-blocking on a worker's own name,
waiting on the contended one), note the moment of the grant, release. The workers are
threads (``kind = "threads"``, :meth:`Design.cycle`) or coroutines of one event loop
(``kind = "async"``, :meth:`Design.acycle`). A design is built in the parent and used in
a forked child, one child per measurement, so no thread or connection of one
measurement is left in the next one's count.

- :class:`SyncThreads`: the sync API (``acquire`` + ``Lease.release``), one thread each.
- :class:`AsyncBuilt`: the async API as built (``aacquire`` + ``Lease.arelease``), every
  database operation through Django's thread-sensitive sync layer. Outside a request
  that layer is one thread for the whole process.
- :class:`AsyncPerRequest`: the same, each coroutine inside its own
  ``ThreadSensitiveContext``, which is what Django's ASGI handler gives every request: a
  thread (and a database connection) per request.
- :class:`AsyncThreadPool`: alternative (i), the same async code with its sync layer
  made thread-*insensitive*: ``sync_to_async(thread_sensitive=False)``, the event loop's
  default thread pool.
- :class:`NativePsycopg`: alternative (ii), PostgreSQL only, a benchmark-only prototype:
  distlock's server functions (``distlock_acquire``, ``distlock_release``; migrations
  0002/0003) called on a small pool of psycopg ``AsyncConnection``s, waiting as the async
  API waits (the loop's shared LISTEN connection, the same back-off).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator
from time import perf_counter
from typing import Any

TTL = 30.0
# A contended worker's blocking acquire gives up after this: never in a healthy run.
WAIT = 120.0
# The native prototype's connection pool, at most (fewer for fewer coroutines).
NATIVE_POOL = 8
THREAD_POOL = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor size


class TimedOut(RuntimeError):
    """A waiting acquire gave up: the measurement is not valid."""


class Design:
    """One way of running acquire + release cycles."""

    label = ""
    kind = "async"  # "threads" or "async"
    vendors: frozenset[str] | None = None  # None: every database

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def cycle(self, name: str, blocking: bool) -> float:
        """One cycle in the calling thread; returns perf_counter() at the grant."""
        raise NotImplementedError

    async def acycle(self, name: str, blocking: bool) -> float:
        """One cycle in a coroutine; returns perf_counter() at the grant."""
        raise NotImplementedError

    async def start(self, workers: int) -> None:
        """Before the coroutines start (in the child's event loop)."""

    async def stop(self) -> None:
        """After they all finished."""
        from asgiref.sync import sync_to_async
        from django.db import connections

        await sync_to_async(connections.close_all)()

    @contextlib.asynccontextmanager
    async def worker_context(self) -> AsyncIterator[None]:
        """What each coroutine runs inside."""
        yield


def _granted(lease: Any, name: str) -> float:
    if lease is None:
        raise TimedOut(f"no grant of {name!r} within {WAIT} s (or an own name was busy)")
    return perf_counter()


class SyncThreads(Design):
    label = "sync API"
    kind = "threads"

    def cycle(self, name: str, blocking: bool) -> float:
        from distlock import acquire

        lease = acquire(name, ttl=TTL, blocking=blocking, timeout=WAIT, using=self.alias)
        granted = _granted(lease, name)
        lease.release()
        return granted


class AsyncBuilt(Design):
    label = "as built"

    async def acycle(self, name: str, blocking: bool) -> float:
        from distlock import aacquire

        lease = await aacquire(name, ttl=TTL, blocking=blocking, timeout=WAIT,
                               using=self.alias)
        granted = _granted(lease, name)
        await lease.arelease()
        return granted


class AsyncPerRequest(AsyncBuilt):
    label = "as built, a ThreadSensitiveContext each (ASGI requests)"

    @contextlib.asynccontextmanager
    async def worker_context(self) -> AsyncIterator[None]:
        from asgiref.sync import ThreadSensitiveContext, sync_to_async
        from django.db import connections

        async with ThreadSensitiveContext():
            try:
                yield
            finally:
                # As Django closes a request's connections at its end.
                await sync_to_async(connections.close_all)()

    async def stop(self) -> None:
        pass


class AsyncThreadPool(AsyncBuilt):
    label = f"(i) thread_sensitive=False, pool of {THREAD_POOL}"

    async def start(self, workers: int) -> None:
        # Only in this measurement's child: the async API's sync layer, made
        # thread-insensitive. Fails loudly if the async API stops calling it by this name.
        from asgiref.sync import sync_to_async

        from distlock.core import async_locks, leases

        pooled = functools.partial(sync_to_async, thread_sensitive=False)
        for module in (async_locks, leases):
            assert module.sync_to_async is sync_to_async, module.__name__
            module.sync_to_async = pooled  # type: ignore[attr-defined]

    async def stop(self) -> None:
        # The pool's threads keep their connections until the child exits.
        pass


# distlock's server functions (distlock/migrations/_postgresql.py, 0002_postgresql_functions.py)
ACQUIRE_SQL = ("SELECT status, token, other, remaining_us "
               "FROM distlock_acquire(%s, %s, %s, %s::bigint, %s::bigint)")
RELEASE_SQL = "SELECT held FROM distlock_release(%s, %s, %s::bigint, %s)"


class NativePsycopg(Design):
    label = f"(ii) native psycopg, ≤ {NATIVE_POOL} AsyncConnections"
    vendors = frozenset({"postgresql"})

    def __init__(self, alias: str, conninfo: str) -> None:
        super().__init__(alias)
        self.conninfo = conninfo
        self.idle: asyncio.Queue[Any] | None = None
        self.all: list[Any] = []

    async def start(self, workers: int) -> None:
        import psycopg

        self.idle = asyncio.Queue()
        for _ in range(min(workers, NATIVE_POOL)):
            # prepare_threshold=0: every statement prepared, as distlock's lean cursor does.
            conn = await psycopg.AsyncConnection.connect(
                self.conninfo, autocommit=True, prepare_threshold=0)
            self.all.append(conn)
            self.idle.put_nowait(conn)

    async def stop(self) -> None:
        for conn in self.all:
            await conn.close()

    async def _one(self, sql: str, params: list[Any]) -> Any:
        assert self.idle is not None
        conn = await self.idle.get()
        try:
            cursor = await conn.execute(sql, params)
            return await cursor.fetchone()
        finally:
            self.idle.put_nowait(conn)

    async def acycle(self, name: str, blocking: bool) -> float:
        from distlock.backends.results import Busy
        from distlock.constants import MAX_TOKEN
        from distlock.core.grants import describe_holder, pause_before_retry
        from distlock.waiting.listener import AsyncWaiter

        owner = os.urandom(16).hex()
        holder = describe_holder()
        give_up = time.monotonic() + WAIT
        waiter: AsyncWaiter | None = None
        attempt = 0
        try:
            while True:
                status, token, other, remaining_us = await self._one(
                    ACQUIRE_SQL, [name, owner, holder, round(TTL * 1e6), MAX_TOKEN])
                if status == "granted":
                    break
                assert status == "busy", status
                left = give_up - time.monotonic()
                if not blocking or left <= 0:
                    raise TimedOut(f"no grant of {name!r}")
                if waiter is None:
                    waiter = AsyncWaiter(self.alias, name)
                    await waiter.start()
                    if waiter.listening:
                        continue
                await waiter.wait(pause_before_retry(
                    attempt, Busy(token, other, remaining_us), left))
                attempt += 1
        finally:
            if waiter is not None:
                waiter.stop()
        granted = perf_counter()
        (held,) = await self._one(RELEASE_SQL, [name, owner, token, False])
        assert held, "released a lock it did not hold"
        return granted
