"""The token floor's ``timeline`` (PostgreSQL's failover epoch), and its first record.

``distlock.ops.failover.follow_timeline`` compares each new session's server timeline
with it: a promoted standby has a new one, and its first session raises every token
before anything is granted there. On PostgreSQL the primary's timeline is recorded here,
so the first promotion after the migration is recognised; elsewhere the column stays NULL.
"""

from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps


def record(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    from distlock.backends.pg_timeline import record_sql

    schema_editor.execute(record_sql())


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0004_task_keys"),
    ]

    operations = [
        migrations.AddField(
            model_name="tokenfloor",
            name="timeline",
            field=models.BigIntegerField(editable=False, null=True),
        ),
        migrations.RunPython(record, migrations.RunPython.noop, elidable=True),
    ]
