"""An index of the audit events of rare kinds (took over, broken, lost, stale write), so
"the stale writes" does not walk the whole history for a handful of rows.

The Lock events list filtered by a rare kind without an age, at 10,000,000 events (10,000
stale writes), took 1.7 s on PostgreSQL, 18 s on SQLite and over 160 s on MariaDB: no
index served the kind, so the list walked ``at_us`` back through every event and its
capped count read them all (docs/performance.md, "The rows table").

PostgreSQL and SQLite: a partial index on ``(kind, at_us)`` of the rare kinds' rows
only, which the common kinds' inserts (every grant, renewal and release with the audit
on) never touch. MariaDB has no partial indexes; the full index's cost to the audit
insert path was measured against its use, and decided (docs/performance.md, "Rare event
kinds"). The statements are in distlock/backends/indexes.py.

Building it on a large history: on PostgreSQL ``CREATE INDEX CONCURRENTLY`` (so this
migration is not atomic): audit inserts go on while it reads the table twice. If it is
interrupted it leaves an INVALID index of this name and the next ``migrate`` fails on
it: run ``DROP INDEX CONCURRENTLY distlock_event_rare`` and migrate again. On SQLite it
holds the database's write lock while it reads the table (seconds at 10M events).
"""

from django.db import migrations

from distlock.migrations._operations import RareEventsIndex


class Migration(migrations.Migration):

    atomic = False

    dependencies = [
        ('distlock', '0007_postgresql_handoff'),
    ]

    operations = [
        RareEventsIndex(),
    ]
