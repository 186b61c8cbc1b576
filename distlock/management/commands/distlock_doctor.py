"""Check the lock database: clock skew against this server, SQLite transaction mode,
MariaDB/MySQL collation, isolation and stored procedures, the tables, and whether locks
can be taken inside your transactions. Exits non-zero on any FAIL.

It looks at what the system checks cannot see without a connection: the live clocks,
the collation the lock table really got, the session isolation level, the tables and
procedures. (A missing table or procedure is not a system check: ``migrate`` runs the
checks before it migrates, so such an error would stop the command that creates them.)
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError, CommandParser
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends import backend_for, backend_named
from distlock.backends.results import FAIL, OK, WARN
from distlock.conf import conf
from distlock.db import db_now_us, same_settings
from distlock.management.commands._common import LockCommand, parse_seconds


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
