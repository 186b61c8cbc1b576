"""Server-side lock operations for PostgreSQL (a no-op on other databases).

Each function does what distlock.db does in Python — the locking read, the decision and
the update — inside one statement, so an acquire, renewal or release costs one round trip
and one commit instead of BEGIN, three or four statements and COMMIT. The semantics are
the same: ``SELECT … FOR UPDATE`` before any change, and every time comparison reads
``clock_timestamp()`` after the row lock is held (never ``now()``, which is frozen at
the start of the transaction).

A try on a lock that a committed, unexpired lease holds is refused by a plain read,
without taking the row lock. That writes nothing, so a refusal needs no WAL flush and
does not queue behind the holder's row lock. It is a correct refusal: at the instant of
that read the lock was held by the database clock.

``fillfactor`` leaves room on each page so that the frequent updates of a lock row
(grants, renewals, releases change no indexed column) can stay heap-only (HOT).
"""

from django.db import migrations

NOW_US = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"

FUNCTIONS = f"""
CREATE OR REPLACE FUNCTION distlock_acquire(
    p_name text, p_owner text, p_holder text, p_ttl_us bigint, p_max_token bigint,
    OUT status text, OUT token bigint, OUT acquired_us bigint, OUT expires_us bigint,
    OUT other text, OUT remaining_us bigint
) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r distlock_lock%ROWTYPE;
    now_us bigint;
    top bigint;
BEGIN
    LOOP
        -- A look without the row lock: a held lock is refused without writing anything.
        SELECT * INTO r FROM distlock_lock l WHERE l.name = p_name;
        IF FOUND THEN
            now_us := {NOW_US};
            IF r.owner <> '' AND r.expires_us > now_us THEN
                status := 'busy'; token := r.token; other := r.holder;
                remaining_us := r.expires_us - now_us;
                RETURN;
            END IF;
            SELECT * INTO r FROM distlock_lock l WHERE l.name = p_name FOR UPDATE;
            IF FOUND THEN
                -- Read the clock only now that the row lock is held.
                now_us := {NOW_US};
                IF r.token >= p_max_token THEN
                    status := 'exhausted'; token := r.token;
                    RETURN;
                END IF;
                IF r.owner <> '' AND r.expires_us > now_us THEN
                    status := 'busy'; token := r.token; other := r.holder;
                    remaining_us := r.expires_us - now_us;
                    RETURN;
                END IF;
                UPDATE distlock_lock l
                   SET token = r.token + 1, owner = p_owner, holder = p_holder,
                       acquired_us = now_us, renewed_us = NULL,
                       expires_us = now_us + p_ttl_us, renew_count = 0
                 WHERE l.name = p_name;
                status := 'granted'; token := r.token + 1;
                acquired_us := now_us; expires_us := now_us + p_ttl_us;
                other := CASE WHEN r.owner <> '' THEN r.holder ELSE '' END;
                RETURN;
            END IF;
            -- Purged between the two reads: start again.
        ELSE
            -- First use of the name: start above every token in the table (purge keeps
            -- the row that holds the largest one).
            SELECT COALESCE(MAX(l.token), 0) INTO top FROM distlock_lock l;
            IF top >= p_max_token THEN
                status := 'exhausted_table'; token := top;
                RETURN;
            END IF;
            now_us := {NOW_US};
            INSERT INTO distlock_lock AS l
                   (name, token, owner, holder, acquired_us, renewed_us, expires_us,
                    renew_count)
            VALUES (p_name, top + 1, p_owner, p_holder, now_us, NULL, now_us + p_ttl_us, 0)
            ON CONFLICT (name) DO NOTHING;
            IF FOUND THEN
                status := 'granted'; token := top + 1;
                acquired_us := now_us; expires_us := now_us + p_ttl_us; other := '';
                RETURN;
            END IF;
            -- Another session created the row first: go round, it exists now.
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION distlock_renew(
    p_name text, p_owner text, p_token bigint, p_ttl_us bigint,
    OUT status text, OUT renewed_us bigint, OUT expires_us bigint
) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r distlock_lock%ROWTYPE;
    now_us bigint;
BEGIN
    SELECT * INTO r FROM distlock_lock l WHERE l.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        status := 'missing';
        RETURN;
    END IF;
    IF r.owner <> p_owner OR r.token <> p_token THEN
        status := 'changed';
        RETURN;
    END IF;
    now_us := {NOW_US};
    IF r.expires_us <= now_us THEN
        status := 'expired';
        RETURN;
    END IF;
    UPDATE distlock_lock l
       SET renewed_us = now_us, expires_us = now_us + p_ttl_us,
           renew_count = l.renew_count + 1
     WHERE l.name = p_name;
    status := 'renewed'; renewed_us := now_us; expires_us := now_us + p_ttl_us;
END
$$;

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
END
$$;

ALTER TABLE distlock_lock SET (fillfactor = 70);
"""

DROP = """
ALTER TABLE distlock_lock RESET (fillfactor);
DROP FUNCTION IF EXISTS distlock_release(text, text, bigint);
DROP FUNCTION IF EXISTS distlock_renew(text, text, bigint, bigint);
DROP FUNCTION IF EXISTS distlock_acquire(text, text, text, bigint, bigint);
"""


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FUNCTIONS, params=None)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0001_initial"),
    ]

    operations = [
        migrations.RunPython(create, drop, elidable=False),
    ]
