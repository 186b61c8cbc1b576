"""Child-process roles for tests/test_partition.py, run on a "host" (a network namespace).

``holder`` is a lock user driven command by command whose fenced writes are the stress
harness's (tests/support/stress_workers.py: the Resource +1 and its ground-truth Write
row in one transaction), so the history checker can judge them. ``probe`` is a bare
connection that runs ``SELECT 1`` when told, to time how long a call hangs on a
connection with the driver's defaults. Every answer carries ``seconds``: how long the
call took, by this process's monotonic clock — how long a cut-off client waits before
it hears anything is what the connection settings under test bound.
"""

from __future__ import annotations

import time
from typing import Any

from tests.support.worker import command, emit, lease_data


class _Timer:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def restart(self) -> None:
        self.started = time.monotonic()

    def seconds(self) -> float:
        return round(time.monotonic() - self.started, 3)


def first_error(exc: BaseException) -> str:
    """The first error of the chain ``exc`` ends: after a failed COMMIT, Django's atomic()
    reconnects to restore autocommit, so what the caller catches is that reconnect's error
    and the COMMIT's own ("Connection timed out": a TCP timeout) is at the chain's start."""
    while exc.__context__ is not None:
        exc = exc.__context__
    return str(exc).splitlines()[0][:200]


def holder(label: str, name: str) -> None:
    """Commands: ``acquire`` (ttl, timeout), ``write`` (op_id; ``wait``: hold the
    transaction open after the write, report ``uncommitted`` and commit on the next
    command, timed from then), ``renew``, ``release``, ``exit``. Outcomes: ``acquired``,
    ``busy``, ``written``, ``stale`` (refused by the fence), ``lost`` (LockLost),
    ``released`` (held), ``dberror`` (the call raised a database error: for a write, its
    outcome is unknown to this client)."""
    from django.db import DatabaseError

    from distlock import LockLost, acquire
    from distlock.exceptions import StaleToken
    from tests.stressapp.models import Resource
    from tests.support.stress_workers import drop_broken_connections, name_connections, write

    name_connections(f"host-{label}")
    lease: Any = None
    emit("ready")
    while True:
        order = command()
        what = order["command"]
        timer = _Timer()

        def wait_for_commit(timer: _Timer = timer) -> None:
            emit("uncommitted")
            command()
            timer.restart()

        try:
            if what == "acquire":
                got = acquire(name, ttl=order["ttl"], timeout=order["timeout"])
                if got is None:
                    emit("busy", seconds=timer.seconds())
                else:
                    lease = got
                    emit("acquired", **lease_data(lease), seconds=timer.seconds())
            elif what == "write":
                value = Resource.objects.values_list("value", flat=True).get(name=name)
                version = write(lease, name, value, order["op_id"], label, fencing=True,
                                before_commit=wait_for_commit if order.get("wait") else None)
                emit("written", version=version, token=lease.token, seconds=timer.seconds())
            elif what == "renew":
                lease.renew()
                emit("renewed", **lease_data(lease), seconds=timer.seconds())
            elif what == "release":
                emit("released", held=lease.release(), seconds=timer.seconds())
            elif what == "exit":
                return
        except LockLost as exc:
            emit("lost", reason=exc.reason, seconds=timer.seconds())
        except StaleToken as exc:
            emit("stale", error=str(exc)[:200], seconds=timer.seconds())
        except DatabaseError as exc:
            emit("dberror", kind=type(exc).__name__, error=str(exc)[:300],
                 cause=first_error(exc), seconds=timer.seconds())
            drop_broken_connections()


def probe(label: str) -> None:
    """Connect, report ``ready``; on ``query`` run SELECT 1 and report ``answered`` or
    ``dberror`` with its duration; ``exit``."""
    from django.db import DatabaseError, connection

    from tests.support.stress_workers import drop_broken_connections, name_connections

    name_connections(f"probe-{label}")
    connection.ensure_connection()
    emit("ready")
    while command()["command"] != "exit":
        timer = _Timer()
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
                cursor.fetchone()
        except DatabaseError as exc:
            emit("dberror", kind=type(exc).__name__, error=str(exc)[:300],
                 cause=first_error(exc), seconds=timer.seconds())
            drop_broken_connections()
        else:
            emit("answered", seconds=timer.seconds())
