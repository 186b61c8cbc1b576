"""The indexes distlock's migrations make in each vendor's own form (migration 0001,
through distlock/migrations/_operations.py), and the query terms that let a partial
index serve its queries.

Partial indexes (PostgreSQL, SQLite) keep an index to the rows its queries ask for, so
the writes that never touch those rows never touch it either; MariaDB and MySQL have
none, and get a full index or none, chosen by measurement (docs/performance.md). They
are not in the models' state: Django's partial index would warn on MariaDB. A base of
:class:`~distlock.backends.base.Backend`, like the token floor's SQL.
"""

from __future__ import annotations

from distlock.constants import EVENT_TABLE, LOCK_TABLE, OWNED_INDEX, RARE_EVENTS_INDEX, RARE_KINDS

# The rare kinds' condition, word for word in the index and in the queries it serves:
# SQLite uses a partial index only when the query's WHERE has its condition's terms.
RARE_KINDS_SQL = "kind IN ({})".format(", ".join(f"'{kind}'" for kind in RARE_KINDS))


class IndexSQL:
    """CREATE and DROP statements of distlock's vendor-specific indexes."""

    #: The rare event kinds' index is partial here, so a query by a rare kind must also
    #: say ``kind IN RARE_KINDS`` (distlock.admin.events.KindFilter) for SQLite to use it.
    rare_events_index: str | None = f"(kind, at_us) WHERE {RARE_KINDS_SQL}"

    #: The audit events' name as the overview groups them: SQLite, grouping by ``name``,
    #: walked the whole ``(name, at_us)`` index (10M events: 5 s) instead of reading the
    #: last hour through ``at_us``; a unary ``+`` keeps it from that index.
    grouped_name_sql: str = "name"
    #: The bounds of a name prefix that many events share, newest first, as terms the
    #: planner reads as true of most rows: ``(lower, upper)``, each with one %s. SQLite,
    #: without statistics, read the whole name range and sorted it (all 10M events: 17 s)
    #: where walking ``at_us`` back stops at a page. None: the planner knows (statistics).
    common_prefix_sql: tuple[str, str] | None = None

    def owned_index_sql(self, create: bool) -> str:
        """Create (or drop) the index of the owned lock rows (migration 0001)."""
        if create:
            # No IF NOT EXISTS: an interrupted CONCURRENTLY build leaves an invalid index
            # of this name, which must fail the next migrate, not pass for built.
            return f"CREATE INDEX {OWNED_INDEX} ON {LOCK_TABLE} (name) WHERE owner > ''"
        return f"DROP INDEX IF EXISTS {OWNED_INDEX}"

    def rare_events_index_sql(self, create: bool) -> str | None:
        """Create (or drop) the index of the audit events of rare kinds (migration 0001);
        None where there is none."""
        if self.rare_events_index is None:
            return None
        if create:
            return f"CREATE INDEX {RARE_EVENTS_INDEX} ON {EVENT_TABLE} {self.rare_events_index}"
        return f"DROP INDEX IF EXISTS {RARE_EVENTS_INDEX}"
