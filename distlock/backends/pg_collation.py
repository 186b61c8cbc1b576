"""PostgreSQL: does the lock table's name column order strings by code point?

Then the names that start with a prefix are one range of the primary key's index, which
is how the admin's search finds them among a million rows (distlock/admin/search.py).
Kept beside distlock/backends/postgresql.py, which calls it, to keep that module short.
"""

from __future__ import annotations

from django.db.backends.base.base import BaseDatabaseWrapper

# Collations that order strings by code point: "C" and "POSIX" compare bytes (UTF-8 byte
# order is code point order); glibc's C.UTF-8 and PostgreSQL 17's builtin one sort by code
# point. Linguistic ones (en_US.UTF-8, ICU) put "a" before "B" and weigh ":" or "-" last,
# so the names starting with a prefix are not one range of their index.
CODE_POINT_COLLATIONS = frozenset({"c", "posix", "c.utf-8", "c.utf8", "ucs_basic", "pg_c_utf8"})
# Sorted differently by every linguistic collation than by code point.
PROBE = ("B", "a", "a b", "a-c", "a:b", "ab", "Z", "é", "\U0010ffff")
# The name column's own collation, else the database's (a column of the default collation
# has none of its own).
NAME_COLLATION_SQL = (
    "SELECT COALESCE(c.collation_name, d.datcollate) FROM information_schema.columns c, "
    "pg_database d WHERE d.datname = current_database() AND c.table_schema = "
    "current_schema() AND c.table_name = 'distlock_lock' AND c.column_name = 'name'"
)


def code_point_order(connection: BaseDatabaseWrapper) -> bool:
    """The column's collation is a code point one by name, and the database sorts a probe
    as code point order does: a database whose default provider is ICU keeps a "C"
    datcollate (PostgreSQL 15+), and the probe catches that."""
    with connection.cursor() as cursor:
        cursor.execute(NAME_COLLATION_SQL)
        row = cursor.fetchone()
        if row is None or str(row[0]).lower() not in CODE_POINT_COLLATIONS:
            return False
        cursor.execute(
            'SELECT array_agg(x ORDER BY x COLLATE "default") FROM unnest(%s::text[]) x',
            [list(PROBE)],
        )
        return list(cursor.fetchone()[0]) == sorted(PROBE)
