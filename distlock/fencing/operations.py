"""Migration operation: a PostgreSQL trigger that refuses to lower a fenced row's token.

Fenced writes never lower ``fence_token`` and plain ORM saves never write it, but raw SQL,
other programs and bulk tools can. With this trigger the database itself refuses any
UPDATE that lowers the column, so the high-water mark holds for every writer::

    from distlock.fencing.operations import RefuseLowerFenceToken

    class Migration(migrations.Migration):
        dependencies = [("shop", "0001_initial")]
        operations = [RefuseLowerFenceToken("Account")]

On other databases the operation does nothing (MariaDB and SQLite triggers cannot raise
a clean error that Django maps to IntegrityError the same way; say so in your README).
"""

from __future__ import annotations

from typing import Any

from django.db.migrations.operations.base import Operation

from distlock.backends import supported
from distlock.backends.base import Backend
from distlock.backends.postgresql import fence_trigger_name
from distlock.constants import FENCE_FIELD


class RefuseLowerFenceToken(Operation):
    """Install (or, backwards, drop) the trigger on ``model_name``'s table; PostgreSQL only.

    An UPDATE lowering ``fence_token`` then fails with IntegrityError (SQLSTATE 23514).
    """

    reversible = True
    reduces_to_sql = True

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def deconstruct(self) -> tuple[str, list[Any], dict[str, Any]]:
        return (f"{__name__}.{type(self).__qualname__}", [self.model_name], {})

    def state_forwards(self, app_label: str, state: Any) -> None:
        pass  # no model state changes

    def _target(
        self, app_label: str, schema_editor: Any, state: Any
    ) -> tuple[Backend, Any] | None:
        """(backend, model) if the trigger belongs on this database, else None."""
        model = state.apps.get_model(app_label, self.model_name)
        connection = schema_editor.connection
        backend = supported(connection)
        if backend is None or not backend.fence_trigger:
            return None
        if not self.allow_migrate_model(connection.alias, model):
            return None
        return backend, model

    @staticmethod
    def trigger_name(table: str) -> str:
        return fence_trigger_name(table)

    def _apply(self, app_label: str, schema_editor: Any, state: Any, *, install: bool) -> None:
        target = self._target(app_label, schema_editor, state)
        if target is None:
            return
        backend, model = target
        if install:
            column = model._meta.get_field(FENCE_FIELD).column
            backend.install_fence_trigger(schema_editor, model._meta.db_table, column)
        else:
            backend.drop_fence_trigger(schema_editor, model._meta.db_table)

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._apply(app_label, schema_editor, to_state, install=True)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        self._apply(app_label, schema_editor, from_state, install=False)

    def describe(self) -> str:
        return f"Refuse UPDATEs lowering {self.model_name}.{FENCE_FIELD} (PostgreSQL trigger)"

    @property
    def migration_name_fragment(self) -> str:
        return f"{self.model_name.lower()}_fence_trigger"
