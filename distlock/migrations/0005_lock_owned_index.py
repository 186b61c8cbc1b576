"""An index of the owned lock rows, so "which locks are held now" does not read them all.

The overview page (asked again every few seconds) and the admin's state filters ask which
locks are held or expired. Without an index that is a scan of the whole lock table: at
1,000,000 rows 70–240 ms for the overview's query and 300–450 ms for ``?state=held``;
with it 1–2 ms and 40–70 ms (docs/performance.md, "Held now"; benchmarks/held.py).

PostgreSQL and SQLite: a partial index on ``name`` of the rows with an owner. It holds
only the held and expired rows, and its key never changes, so a renewal stays a
heap-only (HOT) update on PostgreSQL; a grant and a release, which set or clear the
owner, are not (docs/decisions.md). MariaDB has no partial indexes: an index on
``owner``, which a renewal does not change. The statements are in distlock/backends/,
and the index is not in the model's state (Django would warn on MariaDB).

Building it on a large table: on PostgreSQL ``CREATE INDEX CONCURRENTLY`` (so this
migration is not atomic): grants and releases go on while it reads the table twice
(0.8 s for 1,000,000 rows on the benchmark machine); it also waits for the transactions
already open in the database to end, so a long one delays the migration (not the
grants). If it is interrupted it leaves an INVALID index of this name and the next
``migrate`` fails on it: run ``DROP INDEX CONCURRENTLY distlock_lock_owned`` and migrate
again. On MariaDB it is built online (``ALGORITHM=INPLACE LOCK=NONE``; 0.9 s for 1,000,000
rows). On SQLite it holds the database's write lock while it reads the table.
"""

from django.db import migrations

from distlock.migrations._operations import OwnedIndex


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ('distlock', '0004_lockevent_name_at_index'),
    ]

    operations = [
        OwnedIndex(),
    ]
