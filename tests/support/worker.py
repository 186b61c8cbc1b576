"""The program of the child processes: ``python -m tests.support.worker ROLE ARGS_JSON``.

Started by tests/support/processes.py. ROLE is a name from ROLES below or
``module:function`` (any importable function).

Prints one JSON object per line; reads JSON commands on stdin.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import django

from tests.support.helpers import us


def emit(event: str, **data: Any) -> None:
    print(json.dumps({"event": event, "pid": os.getpid(), **data}), flush=True)


def command() -> dict[str, Any]:
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    return json.loads(line)


def lease_data(lease: Any) -> dict[str, Any]:
    return {
        "token": lease.token, "owner": lease.owner, "acquired_us": us(lease.acquired_at),
        "expires_us": us(lease.expires_at), "remaining": lease.remaining(),
    }


def hammer(name: str, count: int, ttl: float, hold_ms: float) -> None:
    """Acquire, hold briefly, release, ``count`` times; report every grant."""
    from distlock import acquire

    emit("ready")
    command()
    for _ in range(count):
        lease = acquire(name, ttl=ttl, timeout=120)
        assert lease is not None
        time.sleep(random.uniform(0, hold_ms) / 1000)
        held = lease.release()
        emit("grant", **lease_data(lease), released_us=us(lease.released_at), held=held)
    emit("done")


def hold(name: str, ttl: float, timeout: float | None = 30) -> None:
    """Acquire once, then obey commands: renew, release, remaining, exit."""
    from distlock import LockLost, acquire

    lease = acquire(name, ttl=ttl, timeout=timeout)
    if lease is None:
        emit("busy")
        return
    emit("acquired", **lease_data(lease), wall=time.time())
    while True:
        order = command()["command"]
        if order == "renew":
            try:
                lease.renew()
                emit("renewed", **lease_data(lease))
            except LockLost as exc:
                emit("lost", reason=exc.reason)
        elif order == "release":
            emit("released", held=lease.release())
        elif order == "remaining":
            emit("remaining", remaining=lease.remaining())
        elif order == "exit":
            return


def try_once(name: str, ttl: float) -> None:
    """One non-blocking try, after a "go" command: the process starts and connects first,
    so how long a (loaded) machine takes to start it is not part of the try's timing."""
    from django.db import connection

    from distlock import acquire

    connection.ensure_connection()
    emit("ready")
    command()
    lease = acquire(name, ttl=ttl, blocking=False)
    if lease is None:
        emit("busy", wall=time.time())
    else:
        emit("acquired", **lease_data(lease), wall=time.time())


def wait_for(name: str, ttl: float, timeout: float, poll: float | None = None,
             wakeups: bool | None = None, report_pauses: bool = False) -> None:
    """Blocking acquire after a "go" command; reports how long it waited.

    ``poll`` fixes the back-off pause (DISTLOCK_POLL_INTERVAL and _MAX_INTERVAL);
    ``wakeups`` is DISTLOCK_WAKEUPS (None: the settings', which the PgBouncer pass turns
    off). With ``report_pauses`` a "pausing" event is
    printed each time the acquire, refused, starts to wait: the one sure sign that its
    try is over. (Watching pg_stat_activity is not: psycopg prepares a statement in a
    round trip of its own, after which the backend is idle with the statement's text
    although it has not run it yet.)
    """
    from django.db import connection
    from django.test.utils import override_settings

    from distlock import acquire
    from distlock.waiting.queue import Waiter

    if report_pauses:
        wait = Waiter.wait

        def reported(self: Waiter, seconds: float) -> None:
            emit("pausing", seconds=seconds, listening=self.listening)
            wait(self, seconds)

        Waiter.wait = reported  # type: ignore[method-assign]

    options: dict[str, Any] = {} if wakeups is None else {"DISTLOCK_WAKEUPS": wakeups}
    if poll is not None:
        options.update(DISTLOCK_POLL_INTERVAL=poll, DISTLOCK_POLL_MAX_INTERVAL=poll)
    connection.ensure_connection()
    backend = connection.connection.info.backend_pid if connection.vendor == "postgresql" else None
    emit("ready", backend_pid=backend)
    command()
    started = time.monotonic()
    with override_settings(**options):
        lease = acquire(name, ttl=ttl, timeout=timeout)
    if lease is None:
        emit("timeout", waited=time.monotonic() - started)
        return
    emit("acquired", **lease_data(lease), waited=time.monotonic() - started)
    lease.release()


def first_use(names: list[str], ttl: float) -> None:
    """Acquire and release each name once, after a "go": most are used for the first time."""
    from distlock import acquire

    emit("ready")
    command()
    tokens = {}
    for name in names:
        lease = acquire(name, ttl=ttl, timeout=60)
        assert lease is not None
        tokens[name] = lease.token
        assert lease.release()
    emit("done", tokens=tokens)


def cycle_names(names: list[str], grants: int, ttl: float) -> None:
    """After a "go": acquire and release ``names`` in turn, ``grants`` times in all.

    Reports each grant's (name, token, monotonic time after the grant returned). The
    leases never expire, so grants of one name never overlap and those times order them.
    """
    from distlock import acquire

    emit("ready")
    command()
    seen = []
    for i in range(grants):
        name = names[i % len(names)]
        lease = acquire(name, ttl=ttl, timeout=60)
        assert lease is not None
        seen.append([name, lease.token, time.monotonic()])
        assert lease.release()
    emit("done", grants=seen)


def purge_loop(batch: int) -> None:
    """After a "go": purge_locks(idle=0) in batches of ``batch`` rows, over and over,
    until the next line on stdin; reports how many rows it deleted."""
    import select

    import distlock.core.batches
    import distlock.core.purge
    from distlock import purge_locks

    distlock.core.purge.PURGE_BATCH = batch  # type: ignore[misc]
    distlock.core.batches.PURGE_REST = 0.0  # type: ignore[misc]  # race as hard as it can
    emit("ready")
    command()
    purged = rounds = 0
    while not select.select([sys.stdin], [], [], 0)[0]:
        purged += purge_locks(idle=0)
        rounds += 1
    emit("done", purged=purged, rounds=rounds)


ROLES: dict[str, Callable[..., None]] = {
    "cycle_names": cycle_names, "purge_loop": purge_loop,
    "first_use": first_use,
    "hammer": hammer, "hold": hold, "try_once": try_once, "wait_for": wait_for,
}

if __name__ == "__main__":
    # Ctrl-C as in a terminal, whatever the suite was started from: a shell without job
    # control starts a background command with SIGINT ignored, which every process it
    # starts inherits (and Python then installs no KeyboardInterrupt handler), so the tests
    # that send SIGINT to a worker would find it deaf.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    role, args = sys.argv[1], json.loads(sys.argv[2])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    if ":" in role:  # "package.module:function" for roles kept beside other tests
        module, _, function = role.partition(":")
        target = getattr(importlib.import_module(module), function)
    else:
        target = ROLES[role]
    try:
        target(*args)
    except SystemExit:
        raise
    except BaseException as exc:
        emit("error", error=repr(exc), traceback=traceback.format_exc())
        sys.exit(1)
