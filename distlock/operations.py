"""Migration operation: a PostgreSQL trigger that refuses to lower a fenced row's token.

Fenced writes never lower ``fence_token`` and plain ORM saves never write it, but raw SQL,
other programs and bulk tools can. With this trigger the database itself refuses any
UPDATE that lowers the column, so the high-water mark holds for every writer::

    from distlock.operations import RefuseLowerFenceToken

    class Migration(migrations.Migration):
        dependencies = [("shop", "0001_initial")]
        operations = [RefuseLowerFenceToken("Account")]

On other databases the operation does nothing (MariaDB and SQLite triggers cannot raise
a clean error that Django maps to IntegrityError the same way; say so in your README).
"""

from __future__ import annotations

from typing import Any

from django.db.migrations.operations.base import Operation

from distlock.constants import FENCE_FIELD

FUNCTION = "distlock_refuse_lower_fence_token"

_FUNCTION_SQL = f"""
CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS trigger AS $$
BEGIN
    -- TG_ARGV[0] is the column name; the trigger's WHEN clause already compared it.
    RAISE EXCEPTION 'distlock: an UPDATE of % would lower %.% from % to %',
        TG_TABLE_NAME, TG_TABLE_NAME, TG_ARGV[0],
        to_jsonb(OLD) ->> TG_ARGV[0], to_jsonb(NEW) ->> TG_ARGV[0]
        USING ERRCODE = 'check_violation';
END
$$ LANGUAGE plpgsql
"""


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

    def _target(self, app_label: str, schema_editor: Any, state: Any) -> Any:
        model = state.apps.get_model(app_label, self.model_name)
        connection = schema_editor.connection
        if connection.vendor != "postgresql":
            return None
        if not self.allow_migrate_model(connection.alias, model):
            return None
        return model

    @staticmethod
    def trigger_name(table: str) -> str:
        return f"{table}_fence_token_up"[:63]

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        model = self._target(app_label, schema_editor, to_state)
        if model is None:
            return
        quote = schema_editor.quote_name
        table = model._meta.db_table
        column = quote(model._meta.get_field(FENCE_FIELD).column)
        schema_editor.execute(_FUNCTION_SQL, None)  # None: its % are not placeholders
        schema_editor.execute(
            f"DROP TRIGGER IF EXISTS {quote(self.trigger_name(table))} ON {quote(table)}"
        )
        schema_editor.execute(
            f"CREATE TRIGGER {quote(self.trigger_name(table))} BEFORE UPDATE OF {column} "
            f"ON {quote(table)} FOR EACH ROW WHEN (NEW.{column} < OLD.{column}) "
            f"EXECUTE FUNCTION {FUNCTION}('{model._meta.get_field(FENCE_FIELD).column}')"
        )

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        model = self._target(app_label, schema_editor, from_state)
        if model is None:
            return
        quote = schema_editor.quote_name
        table = model._meta.db_table
        schema_editor.execute(
            f"DROP TRIGGER IF EXISTS {quote(self.trigger_name(table))} ON {quote(table)}"
        )

    def describe(self) -> str:
        return f"Refuse UPDATEs lowering {self.model_name}.{FENCE_FIELD} (PostgreSQL trigger)"

    @property
    def migration_name_fragment(self) -> str:
        return f"{self.model_name.lower()}_fence_trigger"
