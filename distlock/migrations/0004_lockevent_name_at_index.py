"""The audit history's index on ``name`` becomes one on ``(name, at_us)``.

"The newest events of these locks" (the admin's timeline picture, a lock's history) then
reads only those events; with ``name`` alone it read every event the lock ever had and
sorted them (a lock with a million events: 0.37 s on PostgreSQL, 0.4 s on SQLite, against
about 0.01 s with this index; benchmarks/timeline.py). The new index replaces the old one,
so each audit insert maintains as many indexes as before; lookups by name alone use its
first column.

Cost of the migration: building the index reads the whole event table and, on
PostgreSQL, blocks audit inserts (and so the grants that record them) while it runs:
about 18 s for 10 million events on the benchmark machine (MariaDB: about a minute). Purge old events first
(``distlock_purge``) or run it at a quiet time. The new index is built before the old one
is dropped, so lookups by name never lose their index on MariaDB, whose DDL does not wait
for the migration's transaction.
"""

from django.db import migrations, models

import distlock.models


class Migration(migrations.Migration):

    dependencies = [
        ('distlock', '0003_token_floor'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='lockevent',
            index=models.Index(fields=['name', 'at_us'], name='distlock_event_name_at'),
        ),
        migrations.AlterField(
            model_name='lockevent',
            name='name',
            field=distlock.models.LockNameField(editable=False, max_length=255),
        ),
    ]
