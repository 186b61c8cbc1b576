"""MariaDB and MySQL: stored procedures for the lock operations, the fenced write's check
folded into its UPDATE, exact names and InnoDB's errors.

Acquire, renew and release are one ``CALL`` each, in autocommit mode: the procedures of
migration 0003 (``distlock_acquire``, ``distlock_renew``, ``distlock_release``, in
:mod:`distlock.backends.mysql_procedures`) run the portable steps of
:mod:`distlock.backends.base` on the server — ``START TRANSACTION``, the ``FOR UPDATE``
read, the clock read after it, the conditional UPDATE, ``COMMIT`` — and answer with one
row. An error rolls the procedure's transaction back and is raised again (RESIGNAL) with
its own code, so a deadlock (1213) is retried by db.run() and a lock-wait timeout (1205)
still means busy.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.core.checks import CheckMessage, Warning
from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends.base import Backend
from distlock.backends.lean_cursor import ReadAtOnce
from distlock.backends.mysql_procedures import DROP, NOW_US, PROCEDURES, procedures_sql
from distlock.backends.results import FAIL, OK, RENEW_REFUSED, WARN, Busy, Grant, exhausted
from distlock.constants import EVENT_TABLE, LOCK_TABLE, MAX_TOKEN, OWNED_INDEX, RARE_EVENTS_INDEX

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

    one_statement: ClassVar[frozenset[str]] = frozenset(
        {"acquire_existing", "renew", "release", "holds"}
    )
    # The fenced write's ownership check in its UPDATE's WHERE (params: name, owner,
    # token). LOCK IN SHARE MODE makes the sub-select a locking read of the latest row,
    # held to the commit, in every isolation level; without it READ COMMITTED (Django's
    # default) reads a snapshot and takes no lock, and a take-over would not wait.
    # Owners compare as bytes: the column's collation may fold case.
    # (Built by folded_owner_check() from now_sql().)

    def now_sql(self) -> str:
        return NOW_US

    def folded_owner_check(self, connection: BaseDatabaseWrapper) -> str | None:
        # A many-row write's all-or-none condition reads the table it writes, which
        # MariaDB allows (10.3.2+) and MySQL refuses (error 1093): MySQL keeps the
        # separate locking read.
        if not _is_mariadb(connection):
            return None
        return (
            f"EXISTS (SELECT 1 FROM {LOCK_TABLE} WHERE name = %s AND owner = CAST(%s AS "
            f"BINARY) AND token = %s AND expires_us > {self.now_sql()} LOCK IN SHARE MODE)"
        )

    def insert_if_absent(
        self, table: str, columns: str, values: str, *, key: str = "name"
    ) -> str:
        # INSERT IGNORE, not "lock if exists else insert": the locking read of a missing
        # key takes a gap lock, and two first users of nearby names then deadlock.
        return f"INSERT IGNORE INTO {table} {columns} {values}"

    def upsert_locking(
        self, table: str, columns: str, values: str, *, key: str, touch: str
    ) -> str:
        # ON DUPLICATE KEY UPDATE takes an exclusive lock on the existing row (INSERT
        # IGNORE a shared one, which a later FOR UPDATE would have to upgrade: deadlock).
        return f"INSERT INTO {table} {columns} {values} ON DUPLICATE KEY UPDATE {touch} = {touch}"

    def owned_index_sql(self, create: bool) -> str:
        # No partial indexes: one on owner, which a renewal does not change. INPLACE and
        # LOCK=NONE: writes go on while it is built.
        if create:
            return (f"CREATE INDEX {OWNED_INDEX} ON {LOCK_TABLE} (owner) "
                    "ALGORITHM=INPLACE LOCK=NONE")
        return f"DROP INDEX IF EXISTS {OWNED_INDEX} ON {LOCK_TABLE}"

    def rare_events_index_sql(self, create: bool) -> str | None:
        # No partial indexes: a full one, which every audit insert maintains
        # (docs/performance.md, "Rare event kinds"). Built online, as the owned rows'.
        if create:
            return (f"CREATE INDEX {RARE_EVENTS_INDEX} ON {EVENT_TABLE} (kind, at_us) "
                    "ALGORITHM=INPLACE LOCK=NONE")
        return f"DROP INDEX IF EXISTS {RARE_EVENTS_INDEX} ON {EVENT_TABLE}"

    def exact_equals_sql(self, sql: str) -> str:
        # The default collations fold case, accents and trailing spaces (PAD SPACE, the
        # _bin ones too); binary strings compare byte for byte and pad nothing.
        return f"CAST({sql} AS BINARY) = CAST(%s AS BINARY)"

    def column_equality_is_safe(self, name: str) -> bool:
        # A column in a smaller character set than the connection's (utf8mb3, latin1)
        # compared with a name it cannot hold raises "Illegal mix of collations" (1267)
        # instead of matching no row. Every character set holds ASCII.
        return name.isascii()

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

    def statement_cursor(self, connection: BaseDatabaseWrapper) -> Any:
        """mysqlclient's own cursor (:class:`_RawCursor`), as :meth:`LeanCursor.reused`
        gives it: Django's cursor goes through two wrappers per call, about a quarter of
        the client CPU of an operation that is one CALL."""
        return _RawCursor.reused(connection)

    # -- the lock operations: stored procedures (migration 0003) ---------------------------

    # Each procedure runs its own START TRANSACTION, which would commit a transaction the
    # cursor's connection has open: there (never from db.run, which refuses to run inside
    # one) the portable steps run instead, inside it.

    def acquire_existing(
        self, cursor: Any, name: str, owner: str, holder: str, ttl_us: int
    ) -> Grant | Busy | None:
        """``distlock_acquire`` also creates a missing row (so it never returns None)."""
        if not _autocommit(cursor):
            return super().acquire_existing(cursor, name, owner, holder, ttl_us)
        status, token, acquired_us, expires_us, other, remaining_us = _call(
            cursor, "CALL distlock_acquire(%s, %s, %s, %s, %s)",
            [name, owner, holder, ttl_us, MAX_TOKEN],
        )
        if status == "granted":
            return Grant(token, acquired_us, expires_us, took_over=other)
        if status == "busy":
            return Busy(token, other, remaining_us)
        raise exhausted(name if status == "exhausted" else None)

    def renew(
        self, cursor: Any, name: str, owner: str, token: int, ttl_us: int
    ) -> Grant | str:
        if not _autocommit(cursor):
            return super().renew(cursor, name, owner, token, ttl_us)
        status, renewed_us, expires_us = _call(
            cursor, "CALL distlock_renew(%s, %s, %s, %s)", [name, owner, token, ttl_us]
        )
        if status != "renewed":
            return RENEW_REFUSED[status]
        return Grant(token, renewed_us, expires_us)

    def release(
        self, cursor: Any, name: str, owner: str, token: int
    ) -> tuple[bool, int | None]:
        if not _autocommit(cursor):
            return super().release(cursor, name, owner, token)
        held, released_us = _call(
            cursor, "CALL distlock_release(%s, %s, %s)", [name, owner, token]
        )
        return bool(held), released_us

    def install_procedures(self, schema_editor: Any, install: bool) -> None:
        """Create (``install``) or drop the procedures (migration 0003)."""
        collation = self.name_collation(schema_editor.connection)
        for sql in procedures_sql(collation or "utf8mb4_nopad_bin") if install else DROP:
            schema_editor.execute(sql, params=None)  # None: no placeholders in routines

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
        missing = self.missing_procedures(connection)
        if missing:
            found.append((FAIL, f"stored procedure(s) {', '.join(missing)} missing (or this "
                                f"user may not EXECUTE them): {_NO_PROCEDURE}"))
        else:
            found.append((OK, f"stored procedures {', '.join(PROCEDURES)} exist"))
        return found

    def missing_procedures(self, connection: BaseDatabaseWrapper) -> list[str]:
        """Which of migration 0003's procedures this connection's user cannot see in its
        database (information_schema lists only routines the user has a privilege on)."""
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT ROUTINE_NAME FROM information_schema.ROUTINES WHERE "
                "ROUTINE_SCHEMA = DATABASE() AND ROUTINE_TYPE = 'PROCEDURE'"
            )
            present = {str(name) for (name,) in cursor.fetchall()}
        return [name for name in PROCEDURES if name not in present]


def _is_mariadb(connection: BaseDatabaseWrapper) -> bool:
    return bool(getattr(connection, "mysql_is_mariadb", False))


class _RawCursor(ReadAtOnce):
    """mysqlclient's connection itself, without its cursor: the statement, its parameters
    quoted by the connection as mysqlclient's cursor quotes them (``literal``), is sent with
    ``query``, and every result set of a CALL is read at once (the row, then the CALL's
    status), so nothing is left behind to make the next statement fail with "commands out
    of sync". Rows come through the connection's own converters, as the cursor's do. The
    cursor's own bookkeeping per statement (description, last row id, its result object)
    was about 30 µs of client CPU per acquire + release (docs/performance.md, "Third
    round"). Like mysqlclient's cursor, ``query`` waits in C without the GIL."""

    def open(self, raw: Any) -> Any:
        self.rows: list[tuple[Any, ...]] = []
        self.count = -1
        self.encoding = raw.encoding
        return None

    def execute(self, sql: str, params: Any = None) -> None:
        raw = self.raw
        query = sql.encode(self.encoding)
        if params:
            query %= tuple([raw.literal(value) for value in params])
        with self.db.wrap_database_errors:
            self.rows = []
            # Interrupted between the query and its result sets (KeyboardInterrupt, a
            # soft time limit), what is left unread would make every later statement fail
            # with "commands out of sync" (2014): db.run_on closes the connection then
            # (Backend.interrupted).
            raw.query(query)
            result = raw.store_result()
            self.count = raw.affected_rows()
            if result is not None:
                self.rows = list(result.fetch_row(0))
            while raw.next_result() == 0:
                raw.store_result()


    def nextset(self) -> Any:
        # execute() read them all.
        return None


def _autocommit(cursor: Any) -> bool:
    """Is the (Django) cursor's connection in autocommit mode, outside atomic()?"""
    connection = getattr(cursor, "db", None)
    return (
        connection is not None and not connection.in_atomic_block
        and connection.get_autocommit()
    )


# What to do about a missing procedure: the doctor's finding and the error of a CALL.
_NO_PROCEDURE = (
    "migration distlock.0003_mysql_procedures has not run on this database, or its "
    "procedures were dropped since (a mysqldump without --routines leaves them out); "
    "acquire, renew and release CALL them. Run `manage.py migrate distlock` (if 0003 is "
    "recorded as applied: `migrate distlock 0002`, then `migrate distlock`)"
)
# "PROCEDURE … does not exist" (ER_SP_DOES_NOT_EXIST).
_NO_SUCH_PROCEDURE = 1305


def _call(cursor: Any, sql: str, params: list[Any]) -> Any:
    """Run a ``CALL`` and return its one row. A CALL answers with the row's result set and
    then its own status: both are read here, or the connection's next statement fails
    with "commands out of sync".

    A missing procedure raises the database's error again (same class, same code 1305)
    with a message that says why and what to run, instead of MariaDB's bare
    "PROCEDURE test.distlock_acquire does not exist".
    """
    try:
        cursor.execute(sql, params)
    except DatabaseError as exc:
        if not exc.args or exc.args[0] != _NO_SUCH_PROCEDURE:
            raise
        procedure = sql.split()[1].split("(")[0]
        raise type(exc)(
            _NO_SUCH_PROCEDURE, f"distlock's stored procedure {procedure} does not exist: "
            f"{_NO_PROCEDURE}. (distlock_doctor checks for them.)",
        ) from exc
    row = cursor.fetchone()
    while cursor.nextset():
        pass
    return row


BACKEND = MySQL
