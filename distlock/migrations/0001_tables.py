"""distlock's tables and indexes, in their final form on every database.

``distlock_lock`` (one row per name), ``distlock_lockevent`` (the audit history, indexed on
``at_us`` and on ``(name, at_us)`` so "the newest events of these locks" reads only theirs)
and ``distlock_floor``, the token floor: one row (id 1) that purge raises to the largest
token it deletes, so a new row starts above one row instead of ``MAX(token)`` over the
whole table (docs/how-it-works.md, "The token floor").

Two indexes in each vendor's own form (distlock/backends/indexes.py, through
_operations.py; not in the model state, where Django's partial index would warn on
MariaDB): the owned lock rows, so "which locks are held now" reads no others, and the
audit events of the rare kinds (took over, broken, lost, stale write). On PostgreSQL they
are built ``CONCURRENTLY``, so this migration is not atomic; on an empty table that costs
nothing, and an interrupted run leaves an INVALID index that fails the next ``migrate``:
``DROP INDEX CONCURRENTLY`` it and migrate again (docs/operations.md).

The squash of distlock 0.2's 0001, 0003, 0004, 0005 and 0008, which made the same tables
and indexes step by step: a database they migrated counts this one as applied. A database
part-way through 0.2's series must finish it with distlock 0.2 first (CHANGELOG.md, 0.3).
"""

from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

import distlock.models
from distlock.migrations._operations import OwnedIndex, RareEventsIndex


def floor_row(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    """The token floor's one row, at 0: the lock table is new and holds no token."""
    TokenFloor = apps.get_model("distlock", "TokenFloor")
    TokenFloor.objects.using(schema_editor.connection.alias).create(id=1, token=0)


class Migration(migrations.Migration):

    initial = True
    # CREATE INDEX CONCURRENTLY (PostgreSQL) cannot run in a transaction.
    atomic = False

    replaces = [
        ("distlock", "0001_initial"),
        ("distlock", "0003_token_floor"),
        ("distlock", "0004_lockevent_name_at_index"),
        ("distlock", "0005_lock_owned_index"),
        ("distlock", "0008_lockevent_rare_index"),
    ]

    dependencies = []

    operations = [
        migrations.CreateModel(
            name='Lock',
            fields=[
                ('name', distlock.models.LockNameField(max_length=255, primary_key=True, serialize=False)),
                ('token', models.BigIntegerField(default=0, editable=False)),
                ('owner', models.CharField(blank=True, default='', editable=False, help_text='Random id of the current grant; empty when the lock is free.', max_length=32)),
                ('holder', models.CharField(blank=True, default='', editable=False, help_text='Who holds it, for people: host, pid, thread, task.', max_length=255)),
                ('acquired_us', models.BigIntegerField(editable=False, null=True)),
                ('renewed_us', models.BigIntegerField(editable=False, null=True)),
                ('expires_us', models.BigIntegerField(editable=False, help_text='End of the lease; for a free lock, when it was released.', null=True)),
                ('renew_count', models.IntegerField(default=0, editable=False)),
            ],
            options={
                'db_table': 'distlock_lock',
                'ordering': ['name'],
                'permissions': [('break_lock', 'Can break locks held by others')],
            },
        ),
        migrations.CreateModel(
            name='TokenFloor',
            fields=[
                ('id', models.PositiveSmallIntegerField(default=1, editable=False, primary_key=True, serialize=False)),
                ('token', models.BigIntegerField(default=0, editable=False)),
            ],
            options={
                'verbose_name': 'token floor',
                'db_table': 'distlock_floor',
            },
        ),
        migrations.CreateModel(
            name='LockEvent',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('at_us', models.BigIntegerField(db_index=True, editable=False)),
                ('kind', models.CharField(choices=[('acquired', 'acquired'), ('took_over', 'expired take-over'), ('renewed', 'renewed'), ('released', 'released'), ('broken', 'broken'), ('lost', 'lost'), ('stale_write', 'stale write refused')], editable=False, max_length=16)),
                ('name', distlock.models.LockNameField(editable=False, max_length=255)),
                ('token', models.BigIntegerField(editable=False, null=True)),
                ('owner', models.CharField(blank=True, default='', editable=False, max_length=32)),
                ('holder', models.CharField(blank=True, default='', editable=False, max_length=255)),
                ('by', models.CharField(blank=True, default='', editable=False, help_text='Who broke the lock (user name or command), for broken locks.', max_length=255)),
                ('detail', models.CharField(blank=True, default='', editable=False, max_length=500)),
            ],
            options={
                'verbose_name': 'lock event',
                'db_table': 'distlock_lockevent',
                'ordering': ['-at_us', '-id'],
                'indexes': [models.Index(fields=['name', 'at_us'], name='distlock_event_name_at')],
            },
        ),
        migrations.RunPython(floor_row, migrations.RunPython.noop, elidable=False),
        OwnedIndex(),
        RareEventsIndex(),
    ]
