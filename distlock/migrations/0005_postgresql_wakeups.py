"""Wake-ups for waiting acquires on PostgreSQL (LISTEN/NOTIFY); a no-op elsewhere.

A blocking acquire that was refused calls ``distlock_listen``: LISTEN on the lock's
channel, then a *shared* session advisory lock on the lock's key. A release (the new
``distlock_release``) or a break calls ``distlock_wake``: if it cannot take that key
exclusively, someone is waiting, and it NOTIFYs the channel, delivered at commit. With
nobody waiting nothing is sent, so an uncontended release does not pay NOTIFY's
commit-time serialization. The key is (1684825963 = "dlck", hashtext(name)); a hash
collision only wakes a waiter early, and a lost notification only leaves the waiter to
its back-off poll. See distlock/wakeups.py.
"""

import importlib

from django.db import migrations

NOW_US = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"
KEY = "1684825963, hashtext(p_name)"

FUNCTIONS = f"""
CREATE OR REPLACE FUNCTION distlock_channel(p_name text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$ SELECT 'distlock_' || left(md5(p_name), 24) $$;

CREATE OR REPLACE FUNCTION distlock_listen(p_name text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- LISTEN first: a release that sees the advisory lock must find the channel heard.
    EXECUTE format('LISTEN %I', distlock_channel(p_name));
    PERFORM pg_advisory_lock_shared({KEY});
END
$$;

CREATE OR REPLACE FUNCTION distlock_unlisten(p_name text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_unlock_shared({KEY});
    EXECUTE format('UNLISTEN %I', distlock_channel(p_name));
END
$$;

CREATE OR REPLACE FUNCTION distlock_wake(p_name text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock({KEY}) THEN
        PERFORM pg_notify(distlock_channel(p_name), '');
    END IF;
END
$$;

-- As in 0003, plus the wake-up at the end.
CREATE OR REPLACE FUNCTION distlock_release(
    p_name text, p_owner text, p_token bigint,
    OUT held boolean, OUT released_us bigint
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
    released_us := {NOW_US};
    UPDATE distlock_lock l SET owner = '', holder = '', expires_us = released_us
     WHERE l.name = p_name;
    held := old_expires > released_us;
    PERFORM distlock_wake(p_name);
END
$$;
"""

DROP = """
DROP FUNCTION IF EXISTS distlock_wake(text);
DROP FUNCTION IF EXISTS distlock_unlisten(text);
DROP FUNCTION IF EXISTS distlock_listen(text);
DROP FUNCTION IF EXISTS distlock_channel(text);
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FUNCTIONS, params=None)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        # 0003's distlock_release (without the wake-up) replaces this one first.
        before = importlib.import_module("distlock.migrations.0003_postgresql_functions")
        schema_editor.execute(before.FUNCTIONS, params=None)
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0004_lockevent"),
    ]

    operations = [
        migrations.RunPython(create, drop, elidable=False),
    ]
