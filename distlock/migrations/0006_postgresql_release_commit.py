"""PostgreSQL: a release need not wait for its WAL flush (a no-op on other databases).

``distlock_release`` gains ``p_durable``: false sets ``synchronous_commit = off`` for the
release's own transaction, so it commits without waiting for the WAL to reach disk.
Only releases: a grant or a renewal lost in a crash would hand out a token twice or let
a holder outlive the lease it was told it had, but a release lost in a crash only leaves
the lock held by the lease that released it until that lease expires — what a holder
that crashed without releasing does anyway. Every later durable commit (the next grant
among them) flushes the WAL up to and including the release, so no grant that survives a
crash can come after a release that did not. ``durable`` tells which kind of commit this
release made. See DISTLOCK_DURABLE_RELEASE in the README.
"""

import importlib

from django.db import migrations

NOW_US = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"

FUNCTIONS = f"""
DROP FUNCTION IF EXISTS distlock_release(text, text, bigint);

CREATE OR REPLACE FUNCTION distlock_release(
    p_name text, p_owner text, p_token bigint, p_durable boolean DEFAULT true,
    OUT held boolean, OUT released_us bigint, OUT durable boolean
) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    old_expires bigint;
BEGIN
    SELECT l.expires_us INTO old_expires FROM distlock_lock l
     WHERE l.name = p_name AND l.owner = p_owner AND l.token = p_token FOR UPDATE;
    IF NOT FOUND THEN
        held := false;
        RETURN;
    END IF;
    IF NOT p_durable THEN
        -- For this transaction only (is_local): it ends with this statement.
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    durable := current_setting('synchronous_commit') <> 'off';
    released_us := {NOW_US};
    UPDATE distlock_lock l SET owner = '', holder = '', expires_us = released_us
     WHERE l.name = p_name;
    held := old_expires > released_us;
    PERFORM distlock_wake(p_name);
END
$$;
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FUNCTIONS, params=None)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "DROP FUNCTION IF EXISTS distlock_release(text, text, bigint, boolean)", params=None
        )
        # 0005's distlock_release comes back.
        before = importlib.import_module("distlock.migrations.0005_postgresql_wakeups")
        schema_editor.execute(before.FUNCTIONS, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0005_postgresql_wakeups"),
    ]

    operations = [
        migrations.RunPython(create, drop, elidable=False),
    ]
