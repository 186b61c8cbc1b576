"""Check the lock database: clock skew against this server, SQLite transaction mode,
MariaDB/MySQL collation, isolation and stored procedures, the tables, and whether locks
can be taken inside your transactions. Exits non-zero on any FAIL. --state also reports
what the database holds: expired locks, stale writes refused, leases lost and locks
broken in the last 24 h, and the audit table's size.

It looks at what the system checks cannot see without a connection: the live clocks,
the collation the lock table really got, the session isolation level, the tables and
procedures. (A missing table or procedure is not a system check: ``migrate`` runs the
checks before it migrates, so such an error would stop the command that creates them.)

``--state`` adds lines about the data after the checks. They are ``[warn]`` at most (the
exit status stays the checks'): an expired lock or a refused stale write is something to
look at, not a broken installation. Every count is read through an index and capped, so
the doctor stays quick beside a million lock rows and ten million events.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError, CommandParser
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends import backend_for, backend_named
from distlock.backends.results import FAIL, OK, WARN
from distlock.conf import conf
from distlock.core.status import EXPIRED, duration, relative, state_is
from distlock.db import db_now_us, same_settings
from distlock.management.commands._common import (
    LockCommand,
    capped,
    local_time,
    parse_seconds,
)
from distlock.models import Lock, LockEvent
from distlock.ops.audit import retention

# --state: how far back "recent" events go, how many expired locks are named, and the
# caps of its counts (each a LIMITed read through an index: bounded at any table size).
RECENT = timedelta(hours=24)
EXPIRED_NAMED = 5
EXPIRED_CAP = 10_000
EVENTS_CAP = 10_000
AUDIT_CAP = 10_000_000
# Events older than the retention by more than this: the purge is not running.
PURGE_SLACK = timedelta(days=1)


def measure_skew(alias: str, samples: int = 5) -> tuple[float, float]:
    """(database clock minus this server's clock, ± uncertainty), in seconds.

    The database's reading is compared with the midpoint of the round trip; the sample
    with the shortest round trip is the most exact.
    """
    db_now_us(alias)  # connect first, so the connection set-up is not measured
    best: tuple[float, float] | None = None
    for _ in range(samples):
        before = time.time()
        db = db_now_us(alias) / 1e6
        after = time.time()
        sample = (db - (before + after) / 2, (after - before) / 2)
        if best is None or sample[1] < best[1]:
            best = sample
    assert best is not None
    return best


class Command(LockCommand):
    def add_options(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--max-skew", default="1",
            help="Warn when the clocks differ by more than this many seconds (default 1).",
        )
        parser.add_argument(
            "--state", action="store_true",
            help="Also report expired locks, stale writes refused, leases lost and locks "
            "broken in the last 24 h, and the audit table's size.",
        )

    def run(self, alias: str, **options: Any) -> None:
        max_skew = parse_seconds(str(options["max_skew"]), "--max-skew")
        connection = connections[alias]
        self.results: list[tuple[str, str]] = []
        self._say(OK, f"lock database {alias!r}: {connection.vendor} "
                      f"({connection.settings_dict.get('NAME')})")
        self._tables(connection)
        self._clock(alias, max_skew)
        for level, message in backend_for(connection).doctor(connection):
            self._say(level, message)
        self._independence(alias, connection)
        if options["state"]:
            self._state(alias, connection)
        failures = sum(1 for level, _ in self.results if level == FAIL)
        warnings = sum(1 for level, _ in self.results if level == WARN)
        if failures:
            raise CommandError(f"distlock_doctor: {failures} problem(s), {warnings} warning(s)")
        self.stdout.write(f"distlock_doctor: no problems, {warnings} warning(s)")

    def _say(self, level: str, message: str) -> None:
        self.results.append((level, message))
        style = {OK: self.style.SUCCESS, WARN: self.style.WARNING, FAIL: self.style.ERROR}
        self.stdout.write(style[level](f"[{level}] {message}"))

    def _tables(self, connection: BaseDatabaseWrapper) -> None:
        tables = set(connection.introspection.table_names())
        if "distlock_lock" not in tables:
            self._say(FAIL, "table distlock_lock is missing: run manage.py migrate distlock")
        else:
            self._say(OK, "table distlock_lock exists")
        if conf.AUDIT and "distlock_lockevent" not in tables:
            self._say(FAIL, "DISTLOCK_AUDIT is on but table distlock_lockevent is missing: "
                            "run manage.py migrate distlock")

    def _clock(self, alias: str, max_skew: float) -> None:
        skew, uncertainty = measure_skew(alias)
        ahead = "ahead of" if skew >= 0 else "behind"
        text = (
            f"database clock is {abs(skew) * 1000:.1f} ms {ahead} this server's "
            f"(± {uncertainty * 1000:.1f} ms)"
        )
        if abs(skew) - uncertainty > max_skew:
            self._say(WARN, text + ". Locks stay safe (expiry is judged by the database "
                      "clock only), but times shown to people and lease.remaining() versus "
                      "expires_at will disagree; fix NTP.")
        else:
            self._say(OK, text)

    def _independence(self, alias: str, connection: BaseDatabaseWrapper) -> None:
        for level, message in independence(alias, connection.vendor, settings.DATABASES):
            self._say(level, message)

    def _state(self, alias: str, connection: BaseDatabaseWrapper) -> None:
        tables = set(connection.introspection.table_names())
        now = db_now_us(alias)
        if "distlock_lock" in tables:
            self._expired(alias, now)
        if "distlock_lockevent" not in tables:
            return  # a FAIL above if audit is on; nothing was ever recorded if it is off
        if conf.AUDIT:
            self._recent(alias, now)
        else:
            self._say(OK, "audit is off (DISTLOCK_AUDIT): stale writes refused, leases lost "
                          "and locks broken are not recorded (the metrics count them per "
                          "process)")
        self._audit_size(alias, now)

    def _expired(self, alias: str, now: int) -> None:
        # Through the index of the owned rows (state_is): the free rows are never read.
        expired = Lock.objects.using(alias).filter(state_is(EXPIRED, now))
        count = expired.order_by()[:EXPIRED_CAP].count()
        if not count:
            self._say(OK, "no expired locks (every owned lease is within its ttl)")
            return
        self._say(WARN, f"{capped(count, EXPIRED_CAP)} expired lock(s), not taken over: "
                        "the holder did not renew or release (dead or paused); the next "
                        "acquire of the name takes it over. The oldest:")
        oldest = expired.order_by("expires_us", "name").values_list(
            "name", "expires_us", "holder")[:EXPIRED_NAMED]
        for name, expires_us, holder in oldest:
            when = "" if expires_us is None else (
                f" {relative(expires_us, now)} ({local_time(expires_us)})")
            self.stdout.write(f"    {name!r} expired{when}, holder {holder or '?'}")

    def _recent(self, alias: str, now: int) -> None:
        since = now - int(RECENT.total_seconds() * 1e6)
        events = LockEvent.objects.using(alias).filter(at_us__gte=since).order_by()

        def count(kind: str) -> int:
            return int(events.filter(kind=kind)[:EVENTS_CAP].count())

        def latest(kind: str) -> str:
            event = events.filter(kind=kind).order_by("-at_us", "-id").first()
            assert event is not None
            return f"the latest on {event.name!r} at {local_time(event.at_us)}"

        stale = count(LockEvent.Kind.STALE_WRITE)
        if stale:
            self._say(WARN, f"{capped(stale, EVENTS_CAP)} stale write(s) refused in the last "
                            f"24 h, {latest(LockEvent.Kind.STALE_WRITE)}: a holder outlived "
                            "its lease (a pause, a ttl shorter than the work) and fencing "
                            "kept its write out")
        else:
            self._say(OK, "no stale writes refused in the last 24 h")
        lost = count(LockEvent.Kind.LOST)
        if lost:
            self._say(WARN, f"{capped(lost, EVENTS_CAP)} lease(s) lost in the last 24 h, "
                            f"{latest(LockEvent.Kind.LOST)}: holders that found their "
                            "lease expired, taken over or broken")
        else:
            self._say(OK, "no leases lost in the last 24 h")
        broken = count(LockEvent.Kind.BROKEN)
        # A break is someone's decision (admin, distlock_break): said, not warned about.
        self._say(OK, f"{capped(broken, EVENTS_CAP)} lock(s) broken in the last 24 h"
                      + (f", {latest(LockEvent.Kind.BROKEN)}" if broken else ""))

    def _audit_size(self, alias: str, now: int) -> None:
        events = LockEvent.objects.using(alias).order_by()
        count = events[:AUDIT_CAP].count()
        if not count:
            self._say(OK, "audit table: no events")
            return
        oldest = events.order_by("at_us").values_list("at_us", flat=True).first()
        assert oldest is not None
        age = (now - oldest) / 1e6
        text = (f"audit table: {capped(count, AUDIT_CAP)} event(s), the oldest "
                f"{duration(age)} old ({local_time(oldest)})")
        try:
            keep = retention()
        except (TypeError, ValueError):
            keep = None  # a bad setting is the system check's (distlock.E021)
        if keep is not None and age > keep + PURGE_SLACK.total_seconds():
            self._say(WARN, f"{text}, older than DISTLOCK_AUDIT_RETENTION ({duration(keep)}) "
                            "by more than a day: run manage.py distlock_purge from cron")
        else:
            self._say(OK, text)


def independence(
    alias: str, vendor: str, databases: dict[str, dict[str, Any]]
) -> list[tuple[str, str]]:
    """Can locks on ``alias`` be taken while the caller is inside ``atomic()``?

    Yes when another alias reaches the same database (the caller's code uses that one and
    the lock alias has its own connection), except on SQLite, which has one writer.
    """
    mine = databases[alias]
    results = []
    if mine.get("ATOMIC_REQUESTS"):
        results.append((WARN, f"{alias!r} has ATOMIC_REQUESTS = True: every view runs in a "
                              "transaction on it, and distlock refuses to lock inside one"))
    others = [
        other for other in databases
        if other != alias and same_settings(databases[other], mine)
    ]
    if not others:
        backend = backend_named(vendor)
        advice = "" if backend is None else " " + backend.own_connection_advice(alias)
        results.append((WARN, f"the lock alias {alias!r} is the connection your code uses: "
                              f"locking inside transaction.atomic() on {alias!r} raises "
                              f"TransactionNotAllowed.{advice}"))
    elif warning := _independence_warning(vendor, alias, others):
        results.append((WARN, warning))
    else:
        results.append((OK, f"the lock alias {alias!r} is its own connection to the database "
                            f"of {', '.join(map(repr, others))}: grants commit on their own, "
                            "also inside your transactions there"))
    return results


def _independence_warning(vendor: str, alias: str, others: list[str]) -> str | None:
    backend = backend_named(vendor)
    return None if backend is None else backend.independence_warning(alias, others)
