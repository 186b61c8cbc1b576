"""The worker of the waiting model (tests/test_waiting_model.py), run by tests.support.worker
as ``tests.support.model_workers:slots``.

One process, ``threads`` slots: slot 0 is the main thread (the only one a SIGINT reaches:
the model's "cancel"), the others threads of their own, each with its own database
connection. Commands on stdin name their slot: ``acquire`` (mode ``block`` with a
timeout, ``nonblock``, ``zero``), ``release``. Every event names its slot and the slot's
backend pid (PostgreSQL; None elsewhere), so the test knows which sessions may be queued.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
from typing import Any

from tests.support.helpers import us
from tests.support.worker import lease_data

_emitting = threading.Lock()


def emit(event: str, **data: Any) -> None:
    """One line per event, whole: two threads print, and print() writes the line and its
    end separately."""
    line = json.dumps({"event": event, "pid": os.getpid(), **data}) + "\n"
    with _emitting:
        sys.stdout.write(line)
        sys.stdout.flush()


def slots(name: str, threads: int, settings: dict[str, Any], lock_timeout: str = "") -> None:
    from django.db import DatabaseError, connection
    from django.test.utils import override_settings

    from distlock import acquire
    from distlock.waiting.queue import Waiter

    override_settings(**settings).enable()
    local = threading.local()
    # SIGINT raises KeyboardInterrupt only while slot 0 is inside acquire(): the model
    # sends it to a waiting slot, which may have been granted meanwhile.
    armed = threading.Event()

    def on_sigint(signum: int, frame: Any) -> None:
        if armed.is_set():
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)

    def backend_pid() -> int | None:
        if connection.vendor != "postgresql" or connection.connection is None:
            return None
        import psycopg

        try:
            return connection.connection.info.backend_pid
        except psycopg.Error:  # closed (a SIGINT cut a query short): Django reconnects
            return None

    def unusable() -> bool:
        """MariaDB: is the connection left unusable ("commands out of sync": an interrupt
        between a CALL and the reading of its results)? It is then closed (Django opens
        a new one), and the test is told."""
        if connection.vendor != "mysql":
            return False
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        except DatabaseError as exc:
            if "out of sync" not in str(exc):
                raise
            connection.close()
            return True
        return False

    wait = Waiter.wait

    def reported(self: Waiter, seconds: float) -> None:
        # The acquire was refused and waits now (queued or polling).
        emit("pausing", slot=local.slot, backend=backend_pid(), listening=self.listening,
             seconds=seconds)
        wait(self, seconds)

    Waiter.wait = reported  # type: ignore[method-assign]

    def take(slot: int, order: dict[str, Any]) -> Any:
        options: dict[str, Any] = {"ttl": order["ttl"]}
        if order["mode"] == "nonblock":
            options["blocking"] = False
        elif order["mode"] == "zero":
            options["timeout"] = 0
        else:
            options["timeout"] = order["timeout"]
        lease = None
        try:
            if slot == 0:
                armed.set()
            try:
                lease = acquire(name, **options)
            finally:
                armed.clear()
        except KeyboardInterrupt:
            if lease is None:
                emit("interrupted", slot=slot, backend=backend_pid(), unusable=unusable())
                return None
            # Interrupted after the grant was returned: it is held all the same.
        if lease is None:
            emit("busy", slot=slot, backend=backend_pid())
        else:
            emit("acquired", slot=slot, backend=backend_pid(), **lease_data(lease))
        return lease

    def serve(slot: int, commands: queue.Queue[dict[str, Any] | None]) -> None:
        local.slot = slot
        connection.ensure_connection()
        if lock_timeout:
            with connection.cursor() as cursor:
                cursor.execute("SELECT set_config('lock_timeout', %s, false)", [lock_timeout])
        emit("ready", slot=slot, backend=backend_pid())
        lease = None
        while (order := commands.get()) is not None:
            if order["command"] == "acquire":
                lease = take(slot, order)
            elif order["command"] == "release":
                assert lease is not None
                try:
                    held = lease.release()
                except DatabaseError as exc:
                    # The session's own lock_timeout cut the release's wait for the row
                    # (another operation held it): not released; it may be tried again.
                    emit("release_failed", slot=slot, backend=backend_pid(),
                         token=lease.token, error=repr(exc))
                    continue
                emit("released", slot=slot, backend=backend_pid(), held=held,
                     token=lease.token, released_us=us(lease.released_at))
                lease = None

    boxes: list[queue.Queue[dict[str, Any] | None]] = [queue.Queue() for _ in range(threads)]

    def read() -> None:
        for line in sys.stdin:
            order = json.loads(line)
            boxes[order["slot"]].put(order)
        for box in boxes:
            box.put(None)

    threading.Thread(target=read, daemon=True).start()
    others = [threading.Thread(target=serve, args=(n, boxes[n]), daemon=True)
              for n in range(1, threads)]
    for thread in others:
        thread.start()
    serve(0, boxes[0])
    for thread in others:
        thread.join()
