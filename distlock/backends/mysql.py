"""MariaDB and MySQL: the portable operations, plus exact names and InnoDB's errors."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Warning
from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends.base import Backend
from distlock.backends.results import FAIL, OK, WARN
from distlock.constants import LOCK_TABLE, OWNED_INDEX

# Deadlock (1213) and "record has changed since last read" (1020) roll the transaction
# back: safe to run it again.
_RETRY_CODES = {1213, 1020}
# A row-lock wait ended by innodb_lock_wait_timeout.
_LOCK_WAIT_CODES = {1205}


def exact_collation(collation: str) -> bool:
    """Does this MariaDB/MySQL collation compare strings byte for byte?

    Only a binary collation that is also NO PAD does: ``utf8mb4_bin`` is binary but PAD
    SPACE, so ``'lock'`` and ``'lock '`` are equal in it. MariaDB spells NO PAD
    ``_nopad_``; MySQL 8's ``utf8mb4_0900_bin`` is NO PAD, as all its ``_0900_`` ones are.
    """
    return collation == "binary" or (
        collation.endswith("_bin") and ("_nopad_" in collation or "_0900_" in collation)
    )


class MySQL(Backend):
    vendor = "mysql"
    share_lock = " LOCK IN SHARE MODE"
    # MariaDB and MySQL have no UPDATE … RETURNING.
    has_update_returning = False

    def now_sql(self) -> str:
        # SYSDATE() is real time; NOW() is fixed at statement start. UNIX_TIMESTAMP reads
        # its argument in the session time zone, which is also SYSDATE's, so the pair is
        # exact.
        return "CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED)"

    def insert_if_absent(
        self, table: str, columns: str, values: str, *, key: str = "name"
    ) -> str:
        # INSERT IGNORE, not "lock if exists else insert": the locking read of a missing
        # key takes a gap lock, and two first users of nearby names then deadlock.
        return f"INSERT IGNORE INTO {table} {columns} {values}"

    def owned_index_sql(self, create: bool) -> str:
        # No partial indexes: one on owner, which a renewal does not change. INPLACE and
        # LOCK=NONE: writes go on while it is built.
        if create:
            return (f"CREATE INDEX {OWNED_INDEX} ON {LOCK_TABLE} (owner) "
                    "ALGORITHM=INPLACE LOCK=NONE")
        return f"DROP INDEX IF EXISTS {OWNED_INDEX} ON {LOCK_TABLE}"

    def name_equals_sql(self, sql: str) -> str:
        # The default collations fold case, accents and trailing spaces.
        return f"COALESCE(CAST({sql} AS BINARY) = CAST(%s AS BINARY), 0)"

    def retryable(self, exc: DatabaseError) -> bool:
        return bool(exc.args) and exc.args[0] in _RETRY_CODES

    def lock_wait_cut_short(self, exc: DatabaseError) -> bool:
        # MariaDB rolls back only the statement, but db.run() leaves its atomic block with
        # the error, which rolls back the rest.
        return bool(exc.args) and exc.args[0] in _LOCK_WAIT_CODES

    def name_field_collation(self, connection: BaseDatabaseWrapper) -> str | None:
        # The default collations fold case, accents and trailing spaces, which would make
        # ``lock``, ``LOCK`` and ``lóck`` one lock; the binary NO PAD collations don't.
        mariadb = getattr(connection, "mysql_is_mariadb", False)
        return "utf8mb4_nopad_bin" if mariadb else "utf8mb4_0900_bin"

    def name_collation(self, connection: BaseDatabaseWrapper) -> str | None:
        """The collation the lock table's ``name`` column really has (None: no table)."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT COLLATION_NAME FROM information_schema.COLUMNS WHERE "
                "TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'distlock_lock' "
                "AND COLUMN_NAME = 'name'"
            )
            row = cursor.fetchone()
        return None if row is None else str(row[0])

    def names_in_code_point_order(self, connection: BaseDatabaseWrapper) -> bool:
        # The binary NO PAD collations compare utf8mb4 bytes: code point order.
        collation = self.name_collation(connection)
        return collation is not None and exact_collation(collation)

    def check_messages(
        self, alias: str, settings_dict: dict[str, Any], *, name_collation: str | None = None
    ) -> list[CheckMessage]:
        """distlock.W002: would two different lock names be one lock?

        Two ways: a name column whose collation folds case, accents or trailing spaces
        (the migration gives it a binary NO PAD one; a hand-made or converted table may
        not have it), or a connection charset other than utf8mb4, in which characters
        outside the Basic Multilingual Plane cannot be sent (they fail, or become "?"
        outside strict mode). Django (5.2+) connects with utf8mb4 unless OPTIONS say
        otherwise, so a missing "charset" is fine.
        """
        problems = []
        charset = settings_dict.get("OPTIONS", {}).get("charset", "utf8mb4")
        if charset != "utf8mb4":
            problems.append(
                f"the connection charset is {charset!r}, in which characters such as emoji "
                "cannot be sent (names with them fail, or collide as '?')"
            )
        if name_collation is not None and not exact_collation(name_collation):
            problems.append(
                f"distlock_lock.name has the collation {name_collation}, which folds case, "
                "accents or trailing spaces ('lock', 'LOCK' and 'lóck' would be one lock)"
            )
        if not problems:
            return []
        return [Warning(
            f"MySQL/MariaDB database {alias!r} would not keep lock names apart exactly: "
            + "; ".join(problems) + ".",
            hint='Leave OPTIONS["charset"] unset (Django uses utf8mb4) or set it to '
            '"utf8mb4"; give distlock_lock.name a binary NO PAD collation '
            "(utf8mb4_nopad_bin on MariaDB, utf8mb4_0900_bin on MySQL), as distlock's "
            "migration creates it.",
            id="distlock.W002",
        )]

    def doctor(self, connection: BaseDatabaseWrapper) -> list[tuple[str, str]]:
        collation = self.name_collation(connection)
        with connection.cursor() as cursor:
            try:
                cursor.execute("SELECT @@SESSION.transaction_isolation")
            except Exception:  # noqa: BLE001 - older servers only know tx_isolation
                cursor.execute("SELECT @@SESSION.tx_isolation")
            isolation = str(cursor.fetchone()[0])
        found = []
        if collation is not None:
            if exact_collation(collation):
                found.append((OK, f"distlock_lock.name collation is {collation} (exact names)"))
            else:
                found.append((FAIL, f"distlock_lock.name collation is {collation}: it folds "
                                    "case, accents or trailing spaces, so different names "
                                    "share a lock; re-run distlock's migrations or ALTER the "
                                    "column to a binary NO PAD collation (utf8mb4_nopad_bin "
                                    "on MariaDB, utf8mb4_0900_bin on MySQL)"))
        level = WARN if isolation.upper().replace("-", " ") == "READ UNCOMMITTED" else OK
        found.append((level, f"session isolation level is {isolation} (lock operations use "
                             "locking reads, which see the latest committed row)"))
        return found


BACKEND = MySQL
