"""PostgreSQL's server-side functions, version 1 (a no-op on other databases).

The functions, the schema they need and the reasons are in
distlock/backends/postgresql_functions.py, which holds every version's text: this
migration installs ``VERSION_1`` and, reversed, drops it (``DROP_1``). The lock
operations are one statement each; the waiting protocol (queue, hand-off, the chain of
entry locks, the first waiters listening) is docs/waiting.md's.

The squash of distlock 0.2's 0002, 0007, 0009, 0010, 0011 and 0012, which defined these
functions step by step: a database they migrated counts this one as applied and keeps
their bodies, which are these but for comments.
"""

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

from distlock.backends.postgresql_functions import DROP_1, VERSION_1


def _run(schema_editor: BaseDatabaseSchemaEditor, sql: str) -> None:
    # Only PostgreSQL has these functions; params=None: no driver placeholders in them.
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(sql, params=None)


def forwards(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _run(schema_editor, VERSION_1)


def backwards(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _run(schema_editor, DROP_1)


class Migration(migrations.Migration):

    replaces = [
        ("distlock", "0002_postgresql_functions"),
        ("distlock", "0007_postgresql_handoff"),
        ("distlock", "0009_postgresql_waiter_chain"),
        ("distlock", "0010_postgresql_fewer_statements"),
        ("distlock", "0011_postgresql_first_waiters_listen"),
        ("distlock", "0012_postgresql_queue_cleanup"),
    ]

    dependencies = [
        ("distlock", "0001_tables"),
    ]

    operations = [
        migrations.RunPython(forwards, backwards, elidable=False),
    ]
