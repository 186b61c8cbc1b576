"""A backend's part in the schema, the system checks and ``distlock_doctor``: the name
column's collation, each vendor's checks of its DATABASES entry and its probes, and the
fenced models' trigger.

The portable answers say "nothing to check"; each vendor's module overrides what it knows.
"""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage
from django.db.backends.base.base import BaseDatabaseWrapper


class SchemaChecks:
    """Mixed into :class:`distlock.backends.base.Backend`."""

    def name_field_collation(self, connection: BaseDatabaseWrapper) -> str | None:
        """The collation LockNameField asks for, where the default would not compare
        names exactly (None: the default does)."""
        return None

    def name_collation(self, connection: BaseDatabaseWrapper) -> str | None:
        """The collation the live lock table's name column has, where it matters."""
        return None

    def names_in_code_point_order(self, connection: BaseDatabaseWrapper) -> bool:
        """Does the name column order strings by code point? Then the names starting with
        a prefix are one range of its index (the admin's search); False when unsure."""
        return False

    def check_messages(
        self, alias: str, settings_dict: dict[str, Any], *, name_collation: str | None = None
    ) -> list[CheckMessage]:
        """The system checks of this vendor for one DATABASES entry."""
        return []

    def doctor(self, connection: BaseDatabaseWrapper) -> list[tuple[str, str]]:
        """distlock_doctor's probes of this vendor: (level, message) pairs."""
        return []

    def install_fence_trigger(self, schema_editor: Any, table: str, column: str) -> None:
        raise NotImplementedError

    def drop_fence_trigger(self, schema_editor: Any, table: str) -> None:
        raise NotImplementedError
