"""PostgreSQL's timeline, the token epoch a promotion advances: the SQL of the timeline follow.

A standby promoted to primary (``pg_ctl promote``, Patroni, any HA manager) starts a new
timeline: the first 8 hex digits of every WAL file name it writes from then on. A
primary that only restarts, even after a crash, stays on its timeline. So a server whose
timeline is not the one recorded in the token floor's row (``distlock_floor.timeline``)
is a promoted standby, which may have missed the last grants of the primary it replaces
(asynchronous replication, or a synchronous wait that was cancelled): its tokens must be
raised above anything that primary can have issued before it grants anything.

:func:`follow` is run by every new session (``connection_created``, see
:func:`distlock.ops.failover.follow_timeline`): one statement when nothing changed. On a
new timeline, the first session raises every token and the floor, ends every lease
(:meth:`~distlock.backends.floor.TokenFloorSQL.raise_tokens`) and records the timeline in
one transaction under the floor row's lock, so sessions that start together on the new
primary raise once. Sent on the driver's own connection (not Django's cursor): it runs
inside Django's connect, before the connection is handed to the caller, and is not one of
the caller's queries (``assertNumQueries``, ``connection.queries``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from distlock.backends.floor import TokenFloorSQL
from distlock.constants import FLOOR_ID, FLOOR_TABLE

# The server's timeline, NULL on a standby (in recovery pg_current_wal_insert_lsn() is an
# error; a standby's sessions cannot grant anyway), and the one recorded. The WAL file
# name is the timeline in 8 hex digits, then the segment's.
CHECK = (
    "SELECT CASE WHEN pg_is_in_recovery() THEN NULL "
    "ELSE substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8) END, "
    f"(SELECT timeline FROM {FLOOR_TABLE} WHERE id = {FLOOR_ID})"
)
# The table or its column is not there: a database distlock was never migrated into (the
# maintenance database Django's test runner uses), or one between migrate's steps.
_NOT_MIGRATED = {"42P01", "42703"}
# Serialization failure, deadlock: the raise is run again (it changed nothing).
_RETRY = {"40001", "40P01"}


def _sqlstate(exc: BaseException) -> str | None:
    # psycopg 3 names it sqlstate, psycopg2 pgcode.
    return getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)


Raised = tuple[int, int, int, list[tuple[str, str, int, str]]]


def read(raw: Any) -> tuple[int | None, int | None] | None:
    """(the server's timeline or None on a standby, the recorded one or None); None if
    distlock's floor table (or its timeline column) is not in this database."""
    cursor = raw.cursor()
    try:
        cursor.execute(CHECK)
        server, recorded = cursor.fetchone()
    except Exception as exc:
        if _sqlstate(exc) in _NOT_MIGRATED:
            return None
        raise
    finally:
        cursor.close()
    return (None if server is None else int(server, 16)), recorded


def follow(floor: TokenFloorSQL, raw: Any, margin: int) -> tuple[int, Raised | None] | None:
    """Compare the server's timeline with the recorded one on ``raw`` (a driver connection
    in autocommit mode); on a difference, raise the tokens (if a timeline was recorded)
    and record the server's.

    Returns None when there was nothing to do (a standby, the same timeline, no floor
    table), else (the server's timeline, what raise_tokens returned or None when only the
    first record was made). Retries a serialization failure or deadlock.
    """
    found = read(raw)
    if found is None or found[0] is None or found[0] == found[1]:
        return None
    timeline = found[0]
    for attempt in range(1, 6):
        try:
            return timeline, _raise_and_record(floor, raw, timeline, margin)
        except Exception as exc:
            if attempt == 5 or _sqlstate(exc) not in _RETRY:
                raise
    raise AssertionError("unreachable")


def _raise_and_record(
    floor: TokenFloorSQL, raw: Any, timeline: int, margin: int
) -> Raised | None:
    cursor = raw.cursor()
    # READ COMMITTED whatever the session's default: a session that waited for another
    # one's raise reads the timeline that one recorded, instead of failing to serialize.
    cursor.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
    try:
        floor.floor(cursor, floor.for_update)  # the floor row, put back if missing
        cursor.execute(f"SELECT timeline FROM {FLOOR_TABLE} WHERE id = %s", [FLOOR_ID])
        recorded = cursor.fetchone()[0]
        raised = None
        if recorded != timeline:
            # No timeline recorded yet (the floor row was put back by a flush): nothing to
            # compare with, so only the record is made; migration 0004 made the first.
            if recorded is not None:
                raised = floor.raise_tokens(cursor, margin)
            cursor.execute(
                f"UPDATE {FLOOR_TABLE} SET timeline = %s WHERE id = %s", [timeline, FLOOR_ID]
            )
        cursor.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(Exception):
            cursor.execute("ROLLBACK")
        raise
    finally:
        with contextlib.suppress(Exception):
            cursor.close()
    return raised


def record_sql() -> str:
    """Migration 0004's first record: the timeline of the primary it runs on."""
    return (
        f"UPDATE {FLOOR_TABLE} SET timeline = ('x' || substr(pg_walfile_name("
        "pg_current_wal_insert_lsn()), 1, 8))::bit(32)::bigint "
        f"WHERE id = {FLOOR_ID} AND NOT pg_is_in_recovery()"
    )
