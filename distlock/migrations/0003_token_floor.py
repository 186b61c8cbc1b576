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

from distlock.migrations._postgresql import ACQUIRE_0002, execute_on_postgresql

# 0002's first-use step of distlock_acquire, and 0003's. The rest of the function is
# 0002's unchanged, so 0003's version is written as this one change to it.
FIRST_USE_0002 = """
            -- First use of the name: start above every token in the table (purge keeps
            -- the row that holds the largest one).
            SELECT COALESCE(MAX(l.token), 0) INTO top FROM distlock_lock l;
"""
FIRST_USE = """
            -- (0003) First use of the name: start above the token floor, which purge
            -- raises to every token it deletes. The share lock holds to the end of the
            -- statement's transaction, and purge raises the floor under FOR UPDATE: no
            -- purge can delete a fresh row of this name and raise the floor between this
            -- read and the INSERT below, which would then give that row's token again.
            SELECT f.token INTO top FROM distlock_floor f WHERE f.id = 1 FOR SHARE;
            IF NOT FOUND THEN
                -- Emptied by a flush: put back what new rows started above before 0003.
                INSERT INTO distlock_floor AS f (id, token)
                VALUES (1, (SELECT COALESCE(MAX(l.token), 0) FROM distlock_lock l))
                ON CONFLICT (id) DO NOTHING;
                SELECT f.token INTO top FROM distlock_floor f WHERE f.id = 1 FOR SHARE;
            END IF;
"""
assert ACQUIRE_0002.count(FIRST_USE_0002) == 1, "0002's first-use step moved"
ACQUIRE = ACQUIRE_0002.replace(FIRST_USE_0002, FIRST_USE)


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
