"""The uniqueness keys of enqueue_once() (distlock/integrations/unique.py): one row per
key, with its queued and running slots (docs/deduplicating-tasks.md)."""

from django.db import migrations, models

import distlock.models


class Migration(migrations.Migration):

    dependencies = [
        ('distlock', '0003_mysql_procedures'),
    ]

    operations = [
        migrations.CreateModel(
            name='TaskKey',
            fields=[
                ('name', distlock.models.LockNameField(editable=False, max_length=255, primary_key=True, serialize=False)),
                ('task', models.CharField(blank=True, default='', editable=False, max_length=255)),
                ('policy', models.CharField(default='queued', editable=False, max_length=32)),
                ('generation', models.BigIntegerField(default=0, editable=False)),
                ('ttl_us', models.BigIntegerField(default=0, editable=False)),
                ('enqueued_us', models.BigIntegerField(editable=False, null=True)),
                ('queued_until_us', models.BigIntegerField(editable=False, help_text='End of the queued slot: a task is sent and has not started.', null=True)),
                ('running_until_us', models.BigIntegerField(editable=False, help_text='End of the running slot: a run is in its body.', null=True)),
                ('running_owner', models.CharField(blank=True, default='', editable=False, help_text='Random id of the run in the running slot.', max_length=32)),
                ('started_us', models.BigIntegerField(editable=False, null=True)),
                ('waiting_us', models.BigIntegerField(editable=False, help_text='Since when a queued run waits in its worker for the running slot.', null=True)),
            ],
            options={
                'verbose_name': 'task key',
                'db_table': 'distlock_taskkey',
                'ordering': ['name'],
            },
        ),
    ]
