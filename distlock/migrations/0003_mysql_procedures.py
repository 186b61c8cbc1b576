"""Stored procedures for the lock operations on MariaDB/MySQL (a no-op elsewhere).

``distlock_acquire``, ``distlock_renew`` and ``distlock_release`` do on the server what
distlock.backends.base does from Python — a transaction of the ``FOR UPDATE`` read, the
clock read after it, the conditional UPDATE and the commit — so each operation is one
``CALL`` in autocommit mode, one round trip instead of five to seven (docs/performance.md).
Their SQL is in distlock/backends/mysql_procedures.py. Creating them needs the CREATE ROUTINE
privilege, calling them EXECUTE (the creator has it); they run with the caller's rights
(SQL SECURITY INVOKER), so dropping the user who migrated breaks nothing. Binary logging
needs nothing more for procedures (log_bin_trust_function_creators is for functions and
triggers). See docs/databases.md. The reverse drops them.

It was 0.2's 0006: a database that applied that counts this one as applied.
"""

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps


def _procedures(schema_editor: BaseDatabaseSchemaEditor, install: bool) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    from distlock.backends.mysql import MySQL

    MySQL().install_procedures(schema_editor, install)


def forwards(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _procedures(schema_editor, True)


def backwards(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    _procedures(schema_editor, False)


class Migration(migrations.Migration):

    # CREATE PROCEDURE is DDL, which MariaDB cannot run inside a transaction.
    atomic = False

    replaces = [
        ("distlock", "0006_mysql_procedures"),
    ]

    dependencies = [
        ("distlock", "0002_postgresql_version_1"),
    ]

    operations = [
        migrations.RunPython(forwards, backwards, elidable=False),
    ]
