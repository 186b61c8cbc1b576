"""The queries of the admin's live overview page, each bounded so the page stays cheap
on a large site (issue 17: every operator view under 150 ms with 1,000,000 lock rows and
10,000,000 audit events), because the page asks them again every few seconds.

- **Held now** (count and the longest held) and **expired, not taken over** (count and
  the most recently expired): each read through the index of the owned rows (migration
  0001), so it costs what is owned, not what the table holds; the count is a window over
  the same read, and only the first ``HELD_LIMIT`` / ``EXPIRED_LIMIT`` rows leave the
  server. The index costs grants and releases their heap-only (HOT) update on
  PostgreSQL, renewals keep it (docs/decisions.md, "Held now").
- **Waiting**: what the wake-up machinery registers. On PostgreSQL a waiting acquire holds
  a shared advisory lock keyed by its name's hash (see :mod:`distlock.waiting.queue`), so
  ``pg_locks`` shows the waiting sessions; their names are found with one more scan of
  the lock table, only when someone waits. Elsewhere, and with wake-ups off, waiters
  poll and register nowhere: the page says so instead of guessing.
- **Most contended in the last hour** (by grants, take-overs included) and **stale
  writes refused, leases lost and locks broken today**: from the audit history, read
  over at most the newest ``EVENT_WINDOW`` events of the period (one walk down the
  ``at_us`` index finds where that window starts); today's rare kinds are counted in one
  grouped query that the rare kinds' index (migration 0001) can also serve. A busier
  period is summarised from its newest events, and the page says so.

All times are the database clock's, like the rows'; "today" starts at midnight in the
site's time zone of the database clock's date (the page shows no other clock).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import (
    BigIntegerField,
    BooleanField,
    CharField,
    Count,
    Max,
    Q,
    Value,
    Window,
)
from django.db.models.expressions import RawSQL
from django.utils import timezone

from distlock.backends import backend_for
from distlock.backends.indexes import RARE_KINDS_SQL
from distlock.conf import conf
from distlock.core.status import EXPIRED, HELD, state_is
from distlock.db import db_now_us
from distlock.models import Lock, LockEvent
from distlock.times import EPOCH, from_us

HELD_LIMIT = 20
EXPIRED_LIMIT = 20
WAITING_LIMIT = 20
CONTENDED_LIMIT = 10
STALE_LIMIT = 10
# The most audit events one refresh reads; at 10M events the walk to the window's start
# is the dearest query of the page (docs/operations.md has the figures).
EVENT_WINDOW = 20_000
HOUR_US = 3600 * 1_000_000


@dataclass
class Contended:
    """One name's grants in the window (take-overs included): how many, to how many
    holders, how many of them were take-overs."""

    name: str
    grants: int
    holders: int
    took_over: int
    last_us: int


@dataclass
class Overview:
    now_us: int
    held: list[Any] = field(default_factory=list)
    held_count: int = 0
    expired: list[Any] = field(default_factory=list)
    expired_count: int = 0
    # None: this database cannot tell who waits (see waiting_note).
    waiting: list[tuple[str, int, str]] | None = None
    waiting_note: str = ""
    contended: list[Contended] = field(default_factory=list)
    contended_capped: bool = False
    stale: list[LockEvent] = field(default_factory=list)
    stale_count: int = 0
    stale_capped: bool = False
    lost_count: int = 0
    broken_count: int = 0
    midnight_us: int = 0
    audit_on: bool = False


def _owned(
    alias: str, state: str, now_us: int, order: tuple[str, ...], limit: int
) -> tuple[list[Any], int]:
    """(the first ``limit`` locks in ``state`` at ``now_us`` by ``order``, how many there
    are): one read of the owned rows' index, the count a window over the same read."""
    rows = list(
        Lock.objects.using(alias)
        .filter(state_is(state, now_us))
        .annotate(
            total=Window(Count("name")), db_now_us=Value(now_us, BigIntegerField()),
            state=Value(state, CharField()),
        )
        .order_by(*order)[:limit]
    )
    return rows, (rows[0].total if rows else 0)


def held_now(alias: str, now_us: int, limit: int = HELD_LIMIT) -> tuple[list[Any], int]:
    """(the ``limit`` longest-held locks, how many are held) in one read of the owned rows.

    Held at ``now_us``, one reading of the database clock, rather than the clock read in
    the query: PostgreSQL would call its volatile clock once per row of the scan.
    """
    return _owned(alias, HELD, now_us, ("acquired_us", "name"), limit)


def expired_now(
    alias: str, now_us: int, limit: int = EXPIRED_LIMIT
) -> tuple[list[Any], int]:
    """(the ``limit`` most recently expired locks, how many there are): owned, their lease
    run out at ``now_us`` and not taken over, so their holder is probably gone (a paused
    or dead process; a live one would have renewed). The next acquire takes them over."""
    return _owned(alias, EXPIRED, now_us, ("-expires_us", "name"), limit)


def waiting(alias: str) -> tuple[list[tuple[str, int, str]] | None, str]:
    """(waited-for locks or None when unknown, a note on what this database can tell)."""
    connection = connections[alias]
    backend = backend_for(connection)
    with connection.cursor() as cursor:
        found = backend.waiting(cursor, WAITING_LIMIT)
    if found is None:
        return None, (
            f"{connection.display_name} does not record waiters: a blocking acquire there "
            "polls the lock row and registers nowhere. The most contended locks below "
            "are the best sign of waiting."
        )
    if not conf.WAKEUPS or not backend.supports_wakeups():
        return found, (
            "Wake-ups are off here (DISTLOCK_WAKEUPS, or psycopg 2): waiters that poll "
            "without them are not seen."
        )
    return found, (
        "Sessions registered for a wake-up: a process, or one event loop for all its "
        "waiting coroutines. Waiters with wake-ups off are not seen."
    )


def midnight_us(now_us: int | None = None) -> int:
    """Today's midnight in the site's time zone, in epoch microseconds: today by the
    database clock's ``now_us`` (the page's one clock), or by this server's without it."""
    now = timezone.localtime(datetime.now(UTC) if now_us is None else from_us(now_us))
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    return (midnight - EPOCH) // timedelta(microseconds=1)


def window_start(alias: str, since_us: int) -> int:
    """The time of the ``EVENT_WINDOW``-th newest event since ``since_us``, or
    ``since_us`` when there are fewer: one walk down the ``at_us`` index."""
    edge = (
        LockEvent.objects.using(alias).filter(at_us__gte=since_us).order_by("-at_us")
        .values_list("at_us", flat=True)[EVENT_WINDOW - 1:EVENT_WINDOW]
    )
    found = list(edge)
    return max(since_us, found[0]) if found else since_us


def most_contended(alias: str, since_us: int) -> list[Contended]:
    """Names granted most often since ``since_us``, take-overs counted as grants (then
    most take-overs first).

    Refused tries are not recorded anywhere, so grants and expired take-overs are what
    the history can show of contention. Not ranked by distinct holders: a lock granted
    510 times an hour to 3 workers is contended, though it has only 3 holder texts.
    """
    grants = [LockEvent.Kind.ACQUIRED, LockEvent.Kind.TOOK_OVER]
    # Grouped by the backend's form of the name: SQLite, grouping by the column itself,
    # walked the whole (name, at_us) index instead of the hour (distlock/backends/).
    grouped = backend_for(connections[alias]).grouped_name_sql
    rows = (
        LockEvent.objects.using(alias).filter(at_us__gte=since_us, kind__in=grants)
        .annotate(key=RawSQL(grouped, [], output_field=CharField()))
        .values("key")
        .annotate(
            grants=Count("id"), holders=Count("holder", distinct=True),
            took_over=Count("id", filter=Q(kind=LockEvent.Kind.TOOK_OVER)),
            last_us=Max("at_us"),
        )
        .order_by("-grants", "-took_over", "key")[:CONTENDED_LIMIT]
    )
    return [
        Contended(name=row["key"], grants=row["grants"], holders=row["holders"],
                  took_over=row["took_over"], last_us=row["last_us"])
        for row in rows
    ]


def stale_writes(alias: str, since_us: int) -> list[LockEvent]:
    """The newest refused stale writes since ``since_us`` (at most ``STALE_LIMIT``)."""
    refused = LockEvent.objects.using(alias).filter(
        at_us__gte=since_us, kind=LockEvent.Kind.STALE_WRITE
    )
    return list(refused.order_by("-at_us", "-id")[:STALE_LIMIT])


TROUBLE = (LockEvent.Kind.STALE_WRITE, LockEvent.Kind.LOST, LockEvent.Kind.BROKEN)


def trouble_counts(alias: str, since_us: int) -> dict[str, int]:
    """How many stale writes were refused, leases lost and locks broken since
    ``since_us``, by kind (0 for none), in one grouped query.

    All three are rare kinds: the rare kinds' condition is added word for word, as the
    events list's kind filter does, so that SQLite may read them through their partial
    index; ``since_us`` (the event window's start at the latest) bounds the read either way.
    """
    rows = (
        LockEvent.objects.using(alias)
        .filter(at_us__gte=since_us, kind__in=TROUBLE)
        .filter(RawSQL(RARE_KINDS_SQL, [], output_field=BooleanField()))
        .values("kind").annotate(n=Count("id")).order_by()
    )
    counts = {str(kind): 0 for kind in TROUBLE}
    counts.update({row["kind"]: row["n"] for row in rows})
    return counts


def overview(alias: str | None = None) -> Overview:
    """Everything the overview page shows, read now from database ``alias``."""
    alias = alias or conf.database()
    now = db_now_us(alias)
    held, held_count = held_now(alias, now)
    expired, expired_count = expired_now(alias, now)
    found, note = waiting(alias)
    hour_ago, midnight = now - HOUR_US, midnight_us(now)
    start = window_start(alias, min(hour_ago, midnight))
    today = max(start, midnight)
    counts = trouble_counts(alias, today)
    return Overview(
        now_us=now, held=held, held_count=held_count, expired=expired,
        expired_count=expired_count, waiting=found, waiting_note=note,
        contended=most_contended(alias, max(start, hour_ago)),
        contended_capped=start > hour_ago, stale=stale_writes(alias, today),
        stale_count=counts[LockEvent.Kind.STALE_WRITE], stale_capped=start > midnight,
        lost_count=counts[LockEvent.Kind.LOST], broken_count=counts[LockEvent.Kind.BROKEN],
        midnight_us=midnight, audit_on=bool(conf.AUDIT),
    )
