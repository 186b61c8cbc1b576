"""distlock_doctor's probe on PostgreSQL: is a transaction pooler (PgBouncer) between
distlock and the server, and does it keep prepared statements per connection?

(Moved out of postgresql.py, unchanged, to keep that module under 400 lines.)
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends.results import FAIL, OK, WARN
from distlock.conf import conf


def is_psycopg3() -> bool:
    # Django's own answer (as postgresql.is_psycopg3 gives it), imported here rather than
    # from postgresql.py, which imports this module: no import cycle.
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    return is_psycopg3


_PID = "SELECT pg_backend_pid()"


def _backend_pid(raw: Any) -> int:
    """The pid of the server backend that ran this statement. Not ``info.backend_pid``:
    that comes from the connection's start-up, where a pooler answers for the server."""
    return int(raw.execute(_PID).fetchone()[0])


def probe_pooler(connection: BaseDatabaseWrapper) -> tuple[str | None, bool | None]:
    """(evidence of transaction pooling or None, whether prepared statements stray).

    Two new connections with the alias's settings, in autocommit, ask for their backend
    pid in turn. Straight to the server (or through a session pooler) each keeps its own
    backend for life; behind a transaction pooler each statement borrows a pooled server
    connection, so one connection's pid changes, or both are served by one backend
    (PgBouncer hands out the most recently used idle server connection first, so with one
    client at a time the second gets the first's). Stateless, so it strands nothing.

    Only when pooled, prepared statements: the first connection prepares one under a
    random name and the second runs it by that name. A pooler that tracks them per client
    (PgBouncer 1.21+ with ``max_prepared_statements``) refuses; one that does not lets the
    second run the first's statement (it is on that server connection), or loses it from
    the first's next transactions: True. It is deallocated again, where it can be reached.
    """
    import psycopg

    params = dict(connection.get_connection_params())
    for key in ("cursor_factory", "context"):  # Django's sync connection's own
        params.pop(key, None)
    with psycopg.connect(autocommit=True, **params) as first, \
            psycopg.connect(autocommit=True, **params) as second:
        evidence = None
        for _ in range(3):
            a1, b, a2 = (_backend_pid(raw) for raw in (first, second, first))
            if a1 != a2:
                evidence = f"one connection's backend pid changed from {a1} to {a2}"
            elif b == a1:
                evidence = f"two connections were served by the same backend (pid {b})"
            if evidence:
                break
        if evidence is None:
            return evidence, None
        name = f"distlock_doctor_{secrets.token_hex(8)}".encode()
        first.pgconn.prepare(name, _PID.encode())
        strays = second.pgconn.exec_prepared(name, None).ntuples == 1 or any(
            first.pgconn.exec_prepared(name, None).ntuples != 1 for _ in range(3)
        )
        for raw in (second, first):
            with contextlib.suppress(psycopg.Error):
                raw.execute(f"DEALLOCATE {name.decode()}")
        return evidence, strays


# Sessions that wait in distlock's queue with wake-ups on hold this advisory lock
# (distlock_queue's "queued", 1684825969, one per name they wait for).
_QUEUED_SESSIONS = (
    "SELECT count(DISTINCT pid) FROM pg_locks WHERE locktype = 'advisory' "
    "AND classid = 1684825969 AND granted AND pid <> pg_backend_pid() AND database = "
    "(SELECT oid FROM pg_database WHERE datname = current_database())"
)


def mixed_wakeups_finding(connection: BaseDatabaseWrapper) -> tuple[str, str] | None:
    """WARN if this process polls (DISTLOCK_WAKEUPS = False) while sessions of others wait
    in the queue with wake-ups on: a release hands the lock to one of those, so the
    pollers starve (issue 27, item 5). Only what is seen now: run it under load."""
    if conf.WAKEUPS:
        return None
    with connection.cursor() as cursor:
        cursor.execute(_QUEUED_SESSIONS)
        queued = int(cursor.fetchone()[0])
    if not queued:
        return None
    return (WARN, f"DISTLOCK_WAKEUPS is False here, but {queued} session(s) wait in "
                  "distlock's queue with wake-ups on: releases hand the lock to them and "
                  "this process's waiting acquires starve. Give DISTLOCK_WAKEUPS the same "
                  "value in every process that uses this database.")


def pooler_findings(connection: BaseDatabaseWrapper) -> list[tuple[str, str]]:
    """distlock_doctor's lines on connection pooling, with the settings it needs."""
    mixed = mixed_wakeups_finding(connection)
    if mixed is not None:
        return [mixed, *_pooling(connection)]
    return _pooling(connection)


def _pooling(connection: BaseDatabaseWrapper) -> list[tuple[str, str]]:
    if not is_psycopg3():
        return [(OK, "psycopg 2: no wake-ups and no prepared statements (nothing a "
                     "transaction pooler could strand); pooling not probed")]
    try:
        evidence, strays = probe_pooler(connection)
    except Exception as exc:  # noqa: BLE001 - the doctor reports, it does not crash
        return [(WARN, f"could not probe for a connection pooler: {exc}")]
    if evidence is None:
        return [(OK, "no transaction pooler: each connection kept its own server session")]
    found = [(OK, f"a transaction pooler (such as PgBouncer with pool_mode = transaction) "
                  f"is between distlock and the server: {evidence}")]
    if conf.WAKEUPS:
        found.append((FAIL, "set DISTLOCK_WAKEUPS = False: a waiting acquire's LISTEN and "
                            "advisory lock would stay on a pooled server connection"))
    else:
        found.append((OK, "DISTLOCK_WAKEUPS is False: waiting acquires poll"))
    if strays and conf.PREPARE_STATEMENTS:
        found.append((FAIL, "set DISTLOCK_PREPARE_STATEMENTS = False: this pooler lets one "
                            "connection's prepared statements reach another (PgBouncer "
                            "before 1.21, or max_prepared_statements = 0)"))
    elif strays:
        found.append((OK, "DISTLOCK_PREPARE_STATEMENTS is False: distlock prepares nothing "
                          "(this pooler does not keep prepared statements per connection)"))
    else:
        found.append((OK, "this pooler keeps prepared statements per connection (as "
                          "PgBouncer 1.21+ with max_prepared_statements > 0 does): "
                          f"DISTLOCK_PREPARE_STATEMENTS = {conf.PREPARE_STATEMENTS} is safe"))
    return found
