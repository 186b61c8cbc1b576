"""PostgreSQL: the ownership check of a one-statement fenced write as a function.

``distlock_holds(name, owner, token)`` is the locking read of ``distlock.fencing``'s
ownership check — the lock row with this owner and token, unexpired by
``clock_timestamp()``, share-locked until the transaction ends — returning whether it
was found. A fenced UPDATE carries it as ``(SELECT distlock_holds(…))``: an uncorrelated
sub-select, so PostgreSQL runs it once, before the first row is written, as it did the
``EXISTS (SELECT … FOR SHARE)`` it replaces. The difference is cost: a PL/pgSQL function
keeps its statement's plan for the session, where the inline sub-select was parsed and
planned again with every write (benchmarks/: about a third of what the check added).
"""

from django.db import migrations

FUNCTIONS = """
CREATE OR REPLACE FUNCTION distlock_holds(p_name text, p_owner text, p_token bigint)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM distlock_lock l
     WHERE l.name = p_name AND l.owner = p_owner AND l.token = p_token
       AND l.expires_us > CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)
       FOR SHARE;
    RETURN FOUND;
END
$$;
"""

DROP = "DROP FUNCTION IF EXISTS distlock_holds(text, text, bigint);"


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FUNCTIONS, params=None)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0006_postgresql_release_commit"),
    ]

    operations = [
        migrations.RunPython(create, drop, elidable=False),
    ]
