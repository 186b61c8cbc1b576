"""The token floor: a new lock row starts above one row, not above the whole table.

Before this migration the first use of a name started its row above
``SELECT MAX(token) FROM distlock_lock`` — a full scan, since ``token`` has no index (an
index would end the heap-only updates every grant relies on), so first uses slowed down
as the table grew (99 ms at a million rows against 0.5 ms empty, on PostgreSQL), and
purge kept the row with the largest token so that the maximum stayed.

Now ``distlock_floor`` holds one row (id 1), which purge raises to the largest token it
deletes in the deleting transaction, and a new row starts at floor + 1. The floor starts
here at the table's largest token, which is at least every token purge ever deleted
(purge always kept a row above them), so an existing database keeps its promise: a
purged name that comes back starts above every token it ever had.

On PostgreSQL ``distlock_acquire`` is redefined with that first-use step; the reverse
puts back 0002's (distlock/migrations/_postgresql.py).
"""

from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

from distlock.migrations._postgresql import ACQUIRE_0002, ACQUIRE_0003, execute_on_postgresql

# 0003's distlock_acquire: 0002's with a new first-use step (both in _postgresql.py).
ACQUIRE = ACQUIRE_0003


def forwards(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    alias = schema_editor.connection.alias
    Lock = apps.get_model("distlock", "Lock")
    TokenFloor = apps.get_model("distlock", "TokenFloor")
    top = Lock.objects.using(alias).aggregate(top=models.Max("token"))["top"] or 0
    TokenFloor.objects.using(alias).update_or_create(id=1, defaults={"token": top})
    execute_on_postgresql(schema_editor, ACQUIRE)


def backwards(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    # 0002's distlock_acquire, exactly (0003 changes no other function).
    execute_on_postgresql(schema_editor, ACQUIRE_0002)


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0002_postgresql_functions"),
    ]

    operations = [
        migrations.CreateModel(
            name="TokenFloor",
            fields=[
                ("id", models.PositiveSmallIntegerField(default=1, editable=False, primary_key=True, serialize=False)),
                ("token", models.BigIntegerField(default=0, editable=False)),
            ],
            options={
                "verbose_name": "token floor",
                "db_table": "distlock_floor",
            },
        ),
        migrations.RunPython(forwards, backwards, elidable=False),
    ]
