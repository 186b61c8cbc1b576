"""What runs beside a lease, off the caller's thread: its auto-renewal (a helper thread for
the sync API, an asyncio task for the async API) and a release deferred until the caller's
transaction lets go of the lock row (:meth:`distlock.core.leases.Lease.release`).

Each keeps a database connection of its own (the thread's) and closes it when done; a
failure of either is the lease's to report (``Lease._lose``), never the caller's thread's.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import TYPE_CHECKING, Protocol

from asgiref.sync import sync_to_async
from django.db import connections

from distlock.conf import conf

if TYPE_CHECKING:
    from distlock.core.leases import Lease, LostCallback

logger = logging.getLogger("distlock")


class Renewer(Protocol):
    """A lease's auto-renewal: a helper thread (sync API) or an asyncio task (async API)."""

    stopped: threading.Event

    def stop(self) -> None: ...


class DeferredRelease(threading.Thread):
    """Releases ``lease`` on its own connection once the caller's transaction ends."""

    def __init__(self, lease: Lease, renewer: Renewer | None) -> None:
        super().__init__(name=f"distlock-release-{lease.name[:40]}", daemon=True)
        self.lease = lease
        self.renewer = renewer

    def run(self) -> None:
        lease = self.lease
        try:
            if self.renewer is not None:
                self.renewer.stop()
            with lease._mutex:
                held, released_us = lease._release_in_database()
            lease._released_by_database(held, released_us)
        except BaseException:  # noqa: BLE001 - nobody to raise to: the lease expires
            logger.exception(
                "deferred release of lock %r (token %s) failed; it is freed when its "
                "lease expires", lease.name, lease.token,
            )
        finally:
            connections.close_all()


class ThreadRenewer(threading.Thread):
    def __init__(self, lease: Lease, on_lost: LostCallback | None) -> None:
        super().__init__(name=f"distlock-renew-{lease.name[:40]}", daemon=True)
        self.lease = lease
        self.on_lost = on_lost
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()
        if self is not threading.current_thread():
            self.join()

    def run(self) -> None:
        try:
            while not self.stopped.wait(self.lease.ttl * float(conf.RENEW_FRACTION)):
                try:
                    self.lease.renew()
                except BaseException as exc:  # noqa: BLE001 - any failure means lost
                    if self.stopped.is_set():
                        return
                    self.lease._lose(str(exc))
                    if self.on_lost is not None:
                        self.on_lost(self.lease, exc)
                    return
        finally:
            connections.close_all()


class AsyncRenewer:
    """The async API's auto-renewal: a task on the loop that acquired the lease."""

    def __init__(self, lease: Lease, on_lost: LostCallback | None) -> None:
        self.lease = lease
        self.on_lost = on_lost
        self.stopped = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.task = self.loop.create_task(self.run(), name=f"distlock-renew-{lease.name[:40]}")

    def stop(self) -> None:
        # release() runs in Django's sync layer, often another thread than the loop's.
        self.stopped.set()
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.task.cancel)

    async def run(self) -> None:
        lease = self.lease
        while not self.stopped.is_set():
            await asyncio.sleep(lease.ttl * float(conf.RENEW_FRACTION))
            try:
                await lease.arenew()
            except Exception as exc:  # noqa: BLE001 - any failure means lost
                if self.stopped.is_set():
                    return
                # lock_lost's receivers may use the database: not on the loop's thread.
                await sync_to_async(lease._lose)(str(exc))
                if self.on_lost is not None:
                    outcome = self.on_lost(lease, exc)
                    if inspect.isawaitable(outcome):
                        await outcome
                return
