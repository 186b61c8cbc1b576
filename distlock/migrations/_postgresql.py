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


# The advisory locks a queued session holds (0007): "alive" while its session lives, and a
# shared lock per name it queues for.
ALIVE = "1684825975, pg_backend_pid()"
QUEUED = "1684825969, hashtext(p_name)"

# 0009's waiter chain (see 0009's docstring): distlock_ahead, distlock_enqueue,
# distlock_follow and distlock_leave, which 0011 derives its versions from and puts back
# when reversed.


def entry(column: str) -> str:
    """The advisory lock key of queue entry ``column`` (an int4 pair)."""
    return f"1684825957, ({column} % 2147483648)::integer"


# How often a waiter blocked behind another checks that its client is still there (ms).
CHECK_CLIENT_MS = 500

# Whether the lock is worth a try now for this session: free, or reserved for it. Read
# FOR SHARE, after the LISTEN (see the module docstring).
FREE = f"""
    SELECT * INTO r FROM distlock_lock l WHERE l.name = p_name FOR SHARE;
    now_us := {NOW_US};
    free := NOT FOUND OR NOT (
        (r.owner <> '' AND r.expires_us > now_us)
        OR (r.reserved_until_us > now_us AND r.reserved_pid <> pg_backend_pid()));
"""

CHAIN_0009 = f"""
CREATE OR REPLACE FUNCTION distlock_ahead(p_name text, p_queued bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    below bigint := p_queued;
    found_id bigint;
BEGIN
    -- The nearest entry ahead whose waiter still holds its entry lock; NULL if none.
    LOOP
        SELECT max(q.id) INTO found_id FROM distlock_waiter q
         WHERE q.name = p_name AND q.id < below;
        IF found_id IS NULL OR NOT pg_try_advisory_lock_shared({entry('found_id')}) THEN
            RETURN found_id;
        END IF;
        PERFORM pg_advisory_unlock_shared({entry('found_id')});
        below := found_id;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION distlock_enqueue(
    p_name text, p_first boolean, p_previous bigint,
    OUT queued bigint, OUT free boolean, OUT ahead integer, OUT head boolean
) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r distlock_lock%ROWTYPE;
    now_us bigint;
BEGIN
    IF p_first THEN
        PERFORM pg_advisory_lock({ALIVE});
        PERFORM pg_advisory_lock_shared({QUEUED});
        -- A waiter killed while it waits in distlock_follow: its backend notices within
        -- this and ends, freeing its entry for the one behind (else it would wait on
        -- until the wait ended). For the session, as the timer is armed when a statement
        -- starts; distlock_leave puts it back. PostgreSQL 14+.
        -- How it was is kept, to be put back as it was: a session's own 0 stays a SET,
        -- the server's default comes back by RESET (no SET left on a pooled session).
        IF current_setting('server_version_num')::integer >= 140000
           AND current_setting('client_connection_check_interval') = '0' THEN
            PERFORM set_config('distlock.checks_client',
                (SELECT CASE WHEN s.source = 'session' THEN 'set' ELSE 'reset' END
                   FROM pg_settings s WHERE s.name = 'client_connection_check_interval'),
                false);
            PERFORM set_config('client_connection_check_interval', '{CHECK_CLIENT_MS}', false);
        END IF;
    END IF;
    -- The entry lock before the row: a waiter that finds the row finds it held.
    queued := nextval('distlock_waiter_id_seq');
    PERFORM pg_advisory_lock({entry('queued')});
    IF p_previous > 0 THEN
        -- Queueing again (a hand-off it missed): the old entry is given up.
        PERFORM pg_advisory_unlock({entry('p_previous')});
    END IF;
    INSERT INTO distlock_waiter (id, name, pid) VALUES (queued, p_name, pg_backend_pid());
    head := distlock_ahead(p_name, queued) IS NULL;
    IF head THEN
        EXECUTE format('LISTEN %I', 'distlock_w' || pg_backend_pid());
    ELSIF NOT p_first THEN
        EXECUTE format('UNLISTEN %I', 'distlock_w' || pg_backend_pid());
    END IF;
    {FREE}
    -- How many will be handed the lock first: the waiter polls the less often.
    SELECT count(*) INTO ahead FROM distlock_waiter q WHERE q.name = p_name AND q.id < queued;
END
$$;

CREATE OR REPLACE FUNCTION distlock_follow(
    p_name text, p_queued bigint, p_wait_ms integer,
    OUT status text, OUT free boolean, OUT moved integer
) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    before bigint;
    until_us bigint := {NOW_US} + p_wait_ms::bigint * 1000;
    left_ms bigint;
    r distlock_lock%ROWTYPE;
    now_us bigint;
BEGIN
    free := false;
    moved := 0;
    LOOP
        before := distlock_ahead(p_name, p_queued);
        EXIT WHEN before IS NULL;
        left_ms := ceil((until_us - {NOW_US}) / 1000.0);
        IF left_ms <= 0 THEN
            status := 'waited';
            RETURN;
        END IF;
        -- For this transaction only (is_local): the session's own setting is back when
        -- the statement ends, whether it succeeded or not.
        PERFORM set_config('lock_timeout', left_ms || 'ms', true);
        BEGIN
            PERFORM pg_advisory_lock_shared({entry('before')});
        EXCEPTION WHEN lock_not_available THEN
            status := 'waited';
            RETURN;
        END;
        PERFORM pg_advisory_unlock_shared({entry('before')});
        moved := moved + 1;
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            -- This transaction's snapshot predates the departure (and a FOR SHARE read
            -- of a row changed since would fail): the caller looks again in a new one.
            status := 'moved';
            RETURN;
        END IF;
        -- READ COMMITTED: each statement below reads what is committed now.
    END LOOP;
    EXECUTE format('LISTEN %I', 'distlock_w' || pg_backend_pid());
    {FREE}
    -- Its row gone: a release handed it the lock (the notification went unheard).
    status := CASE WHEN EXISTS (SELECT 1 FROM distlock_waiter q WHERE q.id = p_queued)
                   THEN 'head' ELSE 'handed' END;
END
$$;

CREATE OR REPLACE FUNCTION distlock_leave(p_name text, p_queued bigint) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM distlock_unqueue(p_name);
    IF current_setting('distlock.checks_client', true) = 'reset' THEN
        RESET client_connection_check_interval;
        RESET distlock.checks_client;
    ELSIF current_setting('distlock.checks_client', true) = 'set' THEN
        PERFORM set_config('client_connection_check_interval', '0', false);
        RESET distlock.checks_client;
    END IF;
    -- Last: the one behind, woken by this, finds the row gone and any reservation
    -- passed on (it waits for this transaction's row lock to read it).
    IF p_queued > 0 THEN
        PERFORM pg_advisory_unlock({entry('p_queued')});
    END IF;
END
$$;
"""
