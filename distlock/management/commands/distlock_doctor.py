"""manage.py distlock_doctor: is this deployment's lock database set up safely?

It looks at what the system checks cannot see without a connection: the live clocks,
the collation the lock table really got, the session isolation level, the tables.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.checks import exact_collation, name_collation
from distlock.conf import conf
from distlock.db import db_now_us
from distlock.management.commands._common import lock_alias, parse_seconds

OK, WARN, FAIL = "ok", "warn", "FAIL"


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


def _same_database(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("ENGINE", "NAME", "HOST", "PORT")
    return all(str(a.get(k) or "") == str(b.get(k) or "") for k in keys)


class Command(BaseCommand):
    help = (
        "Check the lock database: clock skew against this server, SQLite transaction "
        "mode, MariaDB/MySQL collation and isolation, the tables, and whether locks can be "
        "taken inside your transactions. Exits non-zero on any FAIL."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--database", help="Lock database alias (default: distlock's).")
        parser.add_argument(
            "--max-skew", default="1",
            help="Warn when the clocks differ by more than this many seconds (default 1).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        max_skew = parse_seconds(str(options["max_skew"]), "--max-skew")
        alias = lock_alias(options["database"])
        connection = connections[alias]
        self.results: list[tuple[str, str]] = []
        self._say(OK, f"lock database {alias!r}: {connection.vendor} "
                      f"({connection.settings_dict.get('NAME')})")
        self._tables(connection)
        self._clock(alias, max_skew)
        if connection.vendor == "sqlite":
            self._sqlite(connection)
        elif connection.vendor == "mysql":
            self._mysql(connection)
        elif connection.vendor == "postgresql":
            self._postgresql(connection)
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

    def _sqlite(self, connection: BaseDatabaseWrapper) -> None:
        options = connection.settings_dict.get("OPTIONS", {})
        mode = str(options.get("transaction_mode", "") or "DEFERRED").upper()
        if mode == "IMMEDIATE":
            self._say(OK, "SQLite transaction_mode is IMMEDIATE")
        else:
            self._say(FAIL, f"SQLite transaction_mode is {mode}: set OPTIONS['transaction_mode']"
                            " = 'IMMEDIATE', or contending lockers fail with 'database is "
                            "locked' instead of waiting")
        timeout = options.get("timeout")
        if isinstance(timeout, int | float) and timeout > 0:
            self._say(OK, f"SQLite busy timeout is {timeout} s")
        else:
            self._say(FAIL, "SQLite has no busy timeout: set OPTIONS['timeout'], e.g. 20")
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode")
            journal = str(cursor.fetchone()[0]).lower()
        if journal == "wal":
            self._say(OK, "SQLite journal_mode is wal")
        else:
            self._say(WARN, f"SQLite journal_mode is {journal}: WAL lets readers (the admin) "
                            "run while a lock is being written")

    def _mysql(self, connection: BaseDatabaseWrapper) -> None:
        collation = name_collation(connection)
        with connection.cursor() as cursor:
            try:
                cursor.execute("SELECT @@SESSION.transaction_isolation")
            except Exception:  # noqa: BLE001 - older servers only know tx_isolation
                cursor.execute("SELECT @@SESSION.tx_isolation")
            isolation = str(cursor.fetchone()[0])
        if collation is not None:
            if exact_collation(collation):
                self._say(OK, f"distlock_lock.name collation is {collation} (exact names)")
            else:
                self._say(FAIL, f"distlock_lock.name collation is {collation}: it folds case, "
                                "accents or trailing spaces, so different names share a lock;"
                                " re-run distlock's migrations or ALTER the column to a "
                                "binary NO PAD collation (utf8mb4_nopad_bin on MariaDB, "
                                "utf8mb4_0900_bin on MySQL)")
        level = WARN if isolation.upper().replace("-", " ") == "READ UNCOMMITTED" else OK
        self._say(level, f"session isolation level is {isolation} (lock operations use "
                         "locking reads, which see the latest committed row)")

    def _postgresql(self, connection: BaseDatabaseWrapper) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SHOW transaction_isolation")
            isolation = cursor.fetchone()[0]
        self._say(OK, f"session isolation level is {isolation}; serialization failures "
                      "are retried")

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
        if other != alias and _same_database(databases[other], mine)
    ]
    if not others:
        results.append((WARN, f"the lock alias {alias!r} is the connection your code uses: "
                              f"locking inside transaction.atomic() on {alias!r} raises "
                              "TransactionNotAllowed. Add DATABASES['distlock'] = "
                              f"{{**DATABASES[{alias!r}]}} and DISTLOCK_DATABASE = 'distlock'"
                              " if you need to"))
    elif vendor == "sqlite":
        results.append((WARN, f"the lock alias {alias!r} is its own connection, but to the "
                              f"same SQLite file as {', '.join(map(repr, others))}: SQLite has "
                              "one writer, so locking inside atomic() there is still refused"))
    else:
        results.append((OK, f"the lock alias {alias!r} is its own connection to the database "
                            f"of {', '.join(map(repr, others))}: grants commit on their own, "
                            "also inside your transactions there"))
    return results
