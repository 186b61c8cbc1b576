"""PostgreSQL function definitions that more than one migration needs.

A module, not a migration (Django's loader skips names that start with "_"): 0002 creates
``distlock_acquire`` as ``ACQUIRE_0002``, and 0003, which replaces it, puts it back when
reversed. So each version is written once, and no migration loads another through
importlib. A released version is never edited: a change is a new migration.
"""

import textwrap

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps


def execute_on_postgresql(schema_editor: BaseDatabaseSchemaEditor, sql: str) -> None:
    """Run ``sql`` (function DDL, its ``%`` not placeholders) if the database is
    PostgreSQL: the server-side functions exist only there; elsewhere nothing happens."""
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(sql, params=None)


def run_on_postgresql(forwards_sql: str, backwards_sql: str) -> migrations.RunPython:
    """A migration operation running ``forwards_sql`` (reversed: ``backwards_sql``) on
    PostgreSQL only."""

    def forwards(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
        execute_on_postgresql(schema_editor, forwards_sql)

    def backwards(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
        execute_on_postgresql(schema_editor, backwards_sql)

    return migrations.RunPython(forwards, backwards, elidable=False)


# The database's real-time clock in epoch microseconds (clock_timestamp() moves during a
# transaction; now() is frozen at its start).
NOW_US = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"

ACQUIRE_0002 = f"""
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
"""

# 0002's first-use step of distlock_acquire, and 0003's. The rest of the function is
# 0002's unchanged, so 0003's version is written as this one change to it.
FIRST_USE_0002 = """
            -- First use of the name: start above every token in the table (purge keeps
            -- the row that holds the largest one).
            SELECT COALESCE(MAX(l.token), 0) INTO top FROM distlock_lock l;
"""
FIRST_USE = """
            -- (0003) First use of the name: start above the token floor, which purge
            -- raises to every token it deletes. The share lock holds to the end of the
            -- statement's transaction, and purge raises the floor under FOR UPDATE: no
            -- purge can delete a fresh row of this name and raise the floor between this
            -- read and the INSERT below, which would then give that row's token again.
            SELECT f.token INTO top FROM distlock_floor f WHERE f.id = 1 FOR SHARE;
            IF NOT FOUND THEN
                -- Emptied by a flush: put back what new rows started above before 0003.
                INSERT INTO distlock_floor AS f (id, token)
                VALUES (1, (SELECT COALESCE(MAX(l.token), 0) FROM distlock_lock l))
                ON CONFLICT (id) DO NOTHING;
                SELECT f.token INTO top FROM distlock_floor f WHERE f.id = 1 FOR SHARE;
            END IF;
"""
assert ACQUIRE_0002.count(FIRST_USE_0002) == 1, "0002's first-use step moved"
ACQUIRE_0003 = ACQUIRE_0002.replace(FIRST_USE_0002, FIRST_USE)

# 0002's distlock_release, which 0010 replaces and puts back when reversed.
RELEASE_0002 = f"""
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

# 0007's distlock_acquire: 0003's with the hand-off's reservation (see 0007), which 0010
# replaces and puts back when reversed.
HANDOFF_WINDOW_US = 1_000_000

# The busy refusal, inserted before each of distlock_acquire's two busy checks: a lock
# reserved for another session is busy until the window ends.
RESERVED = """
            IF r.reserved_until_us > now_us AND r.reserved_pid <> pg_backend_pid() THEN
                status := 'busy'; token := r.token; other := r.holder;
                remaining_us := GREATEST(r.expires_us, r.reserved_until_us) - now_us;
                RETURN;
            END IF;
"""
LOOK_0003 = """
        IF FOUND THEN
            now_us := {NOW_US};
""".replace("{NOW_US}", NOW_US)
LOCKED_0003 = """
                IF r.token >= p_max_token THEN
                    status := 'exhausted'; token := r.token;
                    RETURN;
                END IF;
"""
GRANT_0003 = """
                       expires_us = now_us + p_ttl_us, renew_count = 0
"""
GRANT = """
                       expires_us = now_us + p_ttl_us, renew_count = 0,
                       reserved_pid = 0, reserved_until_us = 0
"""
for _step in (LOOK_0003, LOCKED_0003, GRANT_0003):
    assert ACQUIRE_0003.count(_step) == 1, "0003's distlock_acquire changed"
ACQUIRE_0007 = (
    ACQUIRE_0003.replace(LOOK_0003, LOOK_0003 + RESERVED.lstrip("\n"))
    .replace(LOCKED_0003, LOCKED_0003 + textwrap.indent(RESERVED.lstrip("\n"), "    "))
    .replace(GRANT_0003, GRANT)
)

