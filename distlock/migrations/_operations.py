"""Migration operations of distlock's own (a module, not a migration: Django's loader
skips names that start with "_")."""

from typing import Any

from django.db import migrations

from distlock.backends import backend_for


class OwnedIndex(migrations.operations.base.Operation):
    """The index of the owned lock rows, in each database's own form and built without
    stopping the grants of a large table: ``CREATE INDEX CONCURRENTLY`` on PostgreSQL
    (the migration is therefore not atomic), online on MariaDB (distlock/backends/).
    Not in the model state: Django's partial index would warn on MariaDB, which has none.
    """

    reversible = True

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        schema_editor.execute(backend_for(schema_editor.connection).owned_index_sql(True))

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        schema_editor.execute(backend_for(schema_editor.connection).owned_index_sql(False))

    def describe(self) -> str:
        return "Index the owned rows of the lock table"
