"""Worker roles of the hand-off tests (tests/test_wakeups.py), run by tests.support.worker
as ``tests.support.handoff_workers:ROLE``."""

from __future__ import annotations

import time
from typing import Any

from tests.support.notifications import count_notifications, received, waits
from tests.support.worker import command, emit, lease_data


def _settings(connection: Any) -> dict[str, str]:
    """The session's timeouts, which waiting in the queue must leave as they were."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting('lock_timeout'), "
                       "current_setting('statement_timeout'), "
                       "current_setting('client_connection_check_interval', true), "
                       "(SELECT source FROM pg_settings "
                       " WHERE name = 'client_connection_check_interval')")
        lock_timeout, statement_timeout, check, source = cursor.fetchone()
    return {"lock_timeout": lock_timeout, "statement_timeout": statement_timeout,
            "client_connection_check_interval": check, "check_source": source}


def in_line(name: str, grants: int, timeout: float, lock_timeout: str = "",
            poll: float | None = None, listeners: int | None = None) -> None:
    """After "go": ``grants`` times a blocking acquire of ``name``, released at once;
    "acquired" per grant; "done" with the notifications received and what ended the
    waits. An acquire that times out ("timeout", with the seconds it took and the
    session's timeouts) or is interrupted by SIGINT ("interrupted") ends the loop; the
    worker then keeps its session until stdin closes, for the test to look at it.
    ``lock_timeout``: the session's own, set first; ``poll``: DISTLOCK_POLL_MAX_INTERVAL
    (a long one shows that nothing was left to the poll); ``listeners``:
    DISTLOCK_LISTENING_WAITERS (None: the default)."""
    from django.db import connection
    from django.test.utils import override_settings

    from distlock import acquire

    count_notifications()
    connection.ensure_connection()
    if lock_timeout:
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('lock_timeout', %s, false)", [lock_timeout])
    emit("ready", backend_pid=connection.connection.info.backend_pid)
    command()
    overrides: dict[str, Any] = {}
    if poll is not None:
        overrides["DISTLOCK_POLL_MAX_INTERVAL"] = poll
    if listeners is not None:
        overrides["DISTLOCK_LISTENING_WAITERS"] = listeners
    with override_settings(**overrides):
        _take_turns(connection, acquire, name, grants, timeout)


def _take_turns(connection: Any, acquire: Any, name: str, grants: int, timeout: float) -> None:
    for _ in range(grants):
        began = time.monotonic()
        try:
            lease = acquire(name, ttl=60, timeout=timeout)
        except KeyboardInterrupt:
            emit("interrupted", waited=time.monotonic() - began, **_settings(connection))
            command()
            return
        if lease is None:
            emit("timeout", waited=time.monotonic() - began, **_settings(connection))
            command()
            return
        emit("acquired", **lease_data(lease))
        lease.release()
    emit("done", notified=received(), waits=waits())
