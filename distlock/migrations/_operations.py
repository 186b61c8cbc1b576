"""Migration operations of distlock's own (a module, not a migration: Django's loader
skips names that start with "_")."""

from typing import Any

from django.db import migrations

from distlock.backends import backend_for


class VendorIndex(migrations.operations.base.Operation):
    """An index in each database's own form (distlock/backends/indexes.py), built without
    stopping the writes of a large table: ``CREATE INDEX CONCURRENTLY`` on PostgreSQL (the
    migration is therefore not atomic), online on MariaDB. Not in the model state:
    Django's partial index would warn on MariaDB, which has none. ``sql_method`` names
    the backend's method that gives the statement (None: no index on that database)."""

    reversible = True
    sql_method = ""
    description = ""

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._run(schema_editor, True)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._run(schema_editor, False)

    def _run(self, schema_editor: Any, create: bool) -> None:
        sql = getattr(backend_for(schema_editor.connection), self.sql_method)(create)
        if sql is not None:
            schema_editor.execute(sql)

    def describe(self) -> str:
        return self.description


class OwnedIndex(VendorIndex):
    """The index of the owned lock rows (migration 0001)."""

    sql_method = "owned_index_sql"
    description = "Index the owned rows of the lock table"


class RareEventsIndex(VendorIndex):
    """The index of the audit events of rare kinds (migration 0001)."""

    sql_method = "rare_events_index_sql"
    description = "Index the audit events of rare kinds"
