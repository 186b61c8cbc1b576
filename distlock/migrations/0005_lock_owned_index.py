"""An index of the owned lock rows, so "which locks are held now" does not read them all.

The overview page, its refresh every few seconds, and the admin's state filters ask which
locks are held (or expired). Without an index that is a scan of the whole lock table:
at 1,000,000 rows 130 ms (PostgreSQL) to 270 ms (MariaDB) for the overview's query and
240–410 ms for ``?state=held``; with it a few milliseconds (docs/decisions.md,
benchmarks/held.py).

PostgreSQL and SQLite: a partial index on ``name`` of the rows with an owner. It holds
only the held and expired rows, and its key never changes, so a renewal stays a
heap-only (HOT) update; a grant and a release, which set or clear the owner, are not.
MariaDB has no partial indexes: an index on ``owner`` (a renewal does not touch it).

Cost of the migration on a large table: on PostgreSQL the index is built with
``CREATE INDEX CONCURRENTLY`` (this migration is therefore not atomic): grants and
releases go on, the build reads the table twice (about a second per million rows) and
waits for transactions already running on the table to finish. If it is interrupted it
leaves an INVALID index of this name: drop it (``DROP INDEX CONCURRENTLY
distlock_lock_owned``) and migrate again. On MariaDB the build is online (``ALGORITHM=INPLACE,
LOCK=NONE``), on SQLite it holds the database's write lock while it reads the table.
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
