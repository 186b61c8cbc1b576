"""PostgreSQL: distlock's server-side functions, in their current form, in one place.

Each lock operation is one statement (``SELECT * FROM distlock_acquire(…)``): the locking
read, the decision and the write run inside the server, one round trip and one commit
(docs/how-it-works.md). Every time comparison reads ``clock_timestamp()`` after the row
lock is held, never ``now()``, frozen at the start of the transaction. The waiting
functions (``distlock_queue`` to ``distlock_leave``) are the protocol of
docs/waiting.md, which names the states and the advisory-lock keys they use:
1684825963 "dlck" (someone LISTENs on the lock's channel), 1684825969 "dlcq" (someone is
queued for the name), 1684825975 "dlcw" (this session is alive), 1684825957 "dlce" (a
queue entry, held by its waiter).

**Versions.** A migration installs a named version of this module and never anything
else: ``VERSION_1`` is what migration 0002 installs. A released version is never edited.
A change writes the next version below it (only the functions that change, taking the
rest from the one before), and a new migration installs it and, reversed, puts the
previous one back. So the current text of every function is read here, not rebuilt from
migration diffs. Version 1 is the squash of distlock 0.2's migrations 0002–0012, with the
same function bodies (comments aside) and the same schema.

The module is SQL text, longer than the house's 400 lines for a module of code: it is
kept whole so that the functions read together, in the order they are created.

The statements take no parameters (``schema_editor.execute(sql, params=None)``): a ``%``
is the modulo operator or a ``format()`` placeholder, never a driver placeholder.
"""

from __future__ import annotations

#: What the functions need besides the tables of the models: the hand-off reservation
#: on the lock row (not in the model: only PostgreSQL hands off), the unlogged queue of
#: waiters (a registration is worth nothing after a crash), and ``fillfactor``, which
#: leaves room on each page so the frequent updates of a lock row (grants, renewals and
#: releases change no column of the held-rows index's key) stay heap-only (HOT).
SCHEMA_1 = """
ALTER TABLE distlock_lock SET (fillfactor = 70);
ALTER TABLE distlock_lock
    ADD COLUMN IF NOT EXISTS reserved_pid integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS reserved_until_us bigint NOT NULL DEFAULT 0;
CREATE UNLOGGED TABLE IF NOT EXISTS distlock_waiter (
    id bigserial PRIMARY KEY,
    name text NOT NULL,
    pid integer NOT NULL
);
CREATE INDEX IF NOT EXISTS distlock_waiter_name ON distlock_waiter (name, id);
"""

#: Version 1's functions, name -> its CREATE statement, in the order they are created.
FUNCTIONS_1: dict[str, str] = {
    "distlock_channel": """
CREATE OR REPLACE FUNCTION distlock_channel(p_name text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$ SELECT 'distlock_' || left(md5(p_name), 24) $$;
""",
    "distlock_listen": """
CREATE OR REPLACE FUNCTION distlock_listen(p_name text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- LISTEN first: a release that sees the advisory lock must find the channel heard.
    EXECUTE format('LISTEN %I', distlock_channel(p_name));
    PERFORM pg_advisory_lock_shared(1684825963, hashtext(p_name));
END
$$;
""",
    "distlock_unlisten": """
CREATE OR REPLACE FUNCTION distlock_unlisten(p_name text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_unlock_shared(1684825963, hashtext(p_name));
    EXECUTE format('UNLISTEN %I', distlock_channel(p_name));
END
$$;
""",
    "distlock_wake": """
CREATE OR REPLACE FUNCTION distlock_wake(p_name text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    w distlock_waiter%ROWTYPE;
    broadcast boolean := NOT pg_try_advisory_xact_lock(1684825963, hashtext(p_name));
    now_us bigint;
BEGIN
    IF NOT pg_try_advisory_xact_lock(1684825969, hashtext(p_name)) THEN
        LOOP
            DELETE FROM distlock_waiter q WHERE q.id = (
                SELECT o.id FROM distlock_waiter o WHERE o.name = p_name
                 ORDER BY o.id LIMIT 1 FOR UPDATE SKIP LOCKED
            ) RETURNING * INTO w;
            EXIT WHEN NOT FOUND;
            -- Gettable only if the waiter's session ended: skip its row.
            CONTINUE WHEN pg_try_advisory_xact_lock(1684825975, w.pid);
            IF NOT broadcast THEN
                -- Read the clock now: the caller holds the lock row.
                now_us := CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT);
                UPDATE distlock_lock l
                   SET reserved_pid = w.pid, reserved_until_us = now_us + 1000000
                 WHERE l.name = p_name AND (l.owner = '' OR l.expires_us <= now_us);
            END IF;
            PERFORM pg_notify('distlock_w' || w.pid, w.id::text);
            EXIT;
        END LOOP;
    END IF;
    IF broadcast THEN
        PERFORM pg_notify(distlock_channel(p_name), '');
    END IF;
END
$$;
""",
    "distlock_holds": """
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
""",
    "distlock_acquire": """
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
        -- Lock the row at once if it looks free: a free lock's grant is then
        -- this read and the UPDATE. A row that looks held or reserved for another
        -- session fails the condition and is not locked: a refusal writes nothing.
        SELECT * INTO r FROM distlock_lock l
         WHERE l.name = p_name
           AND (l.owner = ''
                OR l.expires_us <= CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT))
           AND (l.reserved_until_us
                <= CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)
                OR l.reserved_pid = pg_backend_pid())
           FOR UPDATE;
        IF FOUND THEN
            -- Decide only now that the row lock is held, by the clock read now.
            now_us := CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT);
            IF r.token >= p_max_token THEN
                status := 'exhausted'; token := r.token;
                RETURN;
            END IF;
            IF r.reserved_until_us > now_us AND r.reserved_pid <> pg_backend_pid() THEN
                -- Reserved for another session after all (a release while this waited).
                status := 'busy'; token := r.token; other := r.holder;
                remaining_us := GREATEST(r.expires_us, r.reserved_until_us) - now_us;
                RETURN;
            END IF;
            IF r.owner <> '' AND r.expires_us > now_us THEN
                -- Held after all (granted or renewed while this read waited).
                status := 'busy'; token := r.token; other := r.holder;
                remaining_us := r.expires_us - now_us;
                RETURN;
            END IF;
            UPDATE distlock_lock l
               SET token = r.token + 1, owner = p_owner, holder = p_holder,
                   acquired_us = now_us, renewed_us = NULL,
                   expires_us = now_us + p_ttl_us, renew_count = 0,
                   reserved_pid = 0, reserved_until_us = 0
             WHERE l.name = p_name;
            status := 'granted'; token := r.token + 1;
            acquired_us := now_us; expires_us := now_us + p_ttl_us;
            other := CASE WHEN r.owner <> '' THEN r.holder ELSE '' END;
            RETURN;
        END IF;
        -- Held, reserved for another session, or missing: a look without the row lock.
        SELECT * INTO r FROM distlock_lock l WHERE l.name = p_name;
        IF FOUND THEN
            now_us := CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT);
            IF r.reserved_until_us > now_us AND r.reserved_pid <> pg_backend_pid() THEN
                status := 'busy'; token := r.token; other := r.holder;
                remaining_us := GREATEST(r.expires_us, r.reserved_until_us) - now_us;
                RETURN;
            END IF;
            IF r.owner <> '' AND r.expires_us > now_us THEN
                status := 'busy'; token := r.token; other := r.holder;
                remaining_us := r.expires_us - now_us;
                RETURN;
            END IF;
            -- Freed between the two reads: start again.
        ELSE
            -- First use of the name: start above the token floor, which purge
            -- raises to every token it deletes. The share lock holds to the end of the
            -- statement's transaction, and purge raises the floor under FOR UPDATE: no
            -- purge can delete a fresh row of this name and raise the floor between this
            -- read and the INSERT below, which would then give that row's token again.
            SELECT f.token INTO top FROM distlock_floor f WHERE f.id = 1 FOR SHARE;
            IF NOT FOUND THEN
                -- Emptied by a flush: put back what new rows started above before the floor.
                INSERT INTO distlock_floor AS f (id, token)
                VALUES (1, (SELECT COALESCE(MAX(l.token), 0) FROM distlock_lock l))
                ON CONFLICT (id) DO NOTHING;
                SELECT f.token INTO top FROM distlock_floor f WHERE f.id = 1 FOR SHARE;
            END IF;
            IF top >= p_max_token THEN
                status := 'exhausted_table'; token := top;
                RETURN;
            END IF;
            now_us := CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT);
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
""",
    "distlock_renew": """
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
    now_us := CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT);
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
""",
    "distlock_release": """
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
    released_us := CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT);
    UPDATE distlock_lock l SET owner = '', holder = '', expires_us = released_us
     WHERE l.name = p_name;
    held := old_expires > released_us;
    -- Someone listens (dlck) or is queued (dlcq) only if a key is taken: then
    -- distlock_wake, which takes them again (re-entrant) and decides as before.
    IF NOT (pg_try_advisory_xact_lock(1684825963, hashtext(p_name))
            AND pg_try_advisory_xact_lock(1684825969, hashtext(p_name))) THEN
        PERFORM distlock_wake(p_name);
    END IF;
END
$$;
""",
    "distlock_queue": """
CREATE OR REPLACE FUNCTION distlock_queue(
    p_name text, p_first boolean, OUT queued bigint, OUT free boolean, OUT ahead integer
) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r distlock_lock%ROWTYPE;
    now_us bigint;
BEGIN
    IF p_first THEN
        -- LISTEN and "alive" before the row: a release that finds the row must find both.
        EXECUTE format('LISTEN %I', 'distlock_w' || pg_backend_pid());
        PERFORM pg_advisory_lock(1684825975, pg_backend_pid());
        PERFORM pg_advisory_lock_shared(1684825969, hashtext(p_name));
    END IF;
    INSERT INTO distlock_waiter (name, pid) VALUES (p_name, pg_backend_pid())
    RETURNING id INTO queued;
    -- Is it worth a try now? FOR SHARE waits for a release in flight (it holds the row)
    -- and then reads what it committed; a release after this waits for this transaction,
    -- and then finds the row above. Either way no release goes unseen.
    SELECT * INTO r FROM distlock_lock l WHERE l.name = p_name FOR SHARE;
    now_us := CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT);
    free := NOT FOUND OR NOT (
        (r.owner <> '' AND r.expires_us > now_us)
        OR (r.reserved_until_us > now_us AND r.reserved_pid <> pg_backend_pid()));
    -- How many will be handed the lock first: the waiter polls the less often.
    SELECT count(*) INTO ahead FROM distlock_waiter q WHERE q.name = p_name AND q.id < queued;
END
$$;
""",
    # 0.2's way out of the queue, which distlock no longer calls: kept for a 0.2 client
    # still running during an upgrade. distlock_leave repeats its steps inside the
    # handler block that gives back the session locks (docs/waiting.md).
    "distlock_unqueue": """
CREATE OR REPLACE FUNCTION distlock_unqueue(p_name text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    DELETE FROM distlock_waiter q WHERE q.name = p_name AND q.pid = pg_backend_pid();
    PERFORM pg_advisory_unlock_shared(1684825969, hashtext(p_name));
    PERFORM pg_advisory_unlock(1684825975, pg_backend_pid());
    EXECUTE format('UNLISTEN %I', 'distlock_w' || pg_backend_pid());
    -- Leaving without the grant (timed out, cancelled): hand the reservation on.
    UPDATE distlock_lock l SET reserved_pid = 0, reserved_until_us = 0
     WHERE l.name = p_name AND l.reserved_pid = pg_backend_pid()
       AND l.reserved_until_us > 0;
    IF FOUND THEN
        PERFORM distlock_wake(p_name);
    END IF;
END
$$;
""",
    "distlock_ahead": """
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
        IF found_id IS NULL
           OR NOT pg_try_advisory_lock_shared(1684825957, (found_id % 2147483648)::integer) THEN
            RETURN found_id;
        END IF;
        PERFORM pg_advisory_unlock_shared(1684825957, (found_id % 2147483648)::integer);
        below := found_id;
    END LOOP;
END
$$;
""",
    "distlock_enqueue": """
CREATE OR REPLACE FUNCTION distlock_enqueue(
    p_name text, p_first boolean, p_previous bigint, p_listeners integer DEFAULT 1,
    OUT queued bigint, OUT free boolean, OUT ahead integer, OUT head boolean
) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r distlock_lock%ROWTYPE;
    now_us bigint;
    -- Session-level locks taken (or given up) so far: the handler undoes exactly these.
    has_alive boolean := false;
    has_queued boolean := false;
    has_entry boolean := false;
    dropped_previous boolean := false;
BEGIN
    queued := 0;
    BEGIN
        IF p_first THEN
            PERFORM pg_advisory_lock(1684825975, pg_backend_pid());
            has_alive := true;
            PERFORM pg_advisory_lock_shared(1684825969, hashtext(p_name));
            has_queued := true;
            -- A waiter killed while it waits in distlock_follow: its backend notices
            -- within this and ends, freeing its entry for the one behind. How it was is
            -- kept, to be put back as it was by distlock_leave (PostgreSQL 14+).
            IF current_setting('server_version_num')::integer >= 140000
               AND current_setting('client_connection_check_interval') = '0' THEN
                PERFORM set_config('distlock.checks_client',
                    (SELECT CASE WHEN s.source = 'session' THEN 'set' ELSE 'reset' END
                       FROM pg_settings s WHERE s.name = 'client_connection_check_interval'),
                    false);
                PERFORM set_config('client_connection_check_interval', '500',
                    false);
            END IF;
        END IF;
        -- The entry lock before the row: a waiter that finds the row finds it held.
        queued := nextval('distlock_waiter_id_seq');
        PERFORM pg_advisory_lock(1684825957, (queued % 2147483648)::integer);
        has_entry := true;
        IF p_previous > 0 THEN
            -- Queueing again (a hand-off it missed): the old entry is given up.
            PERFORM pg_advisory_unlock(1684825957, (p_previous % 2147483648)::integer);
            dropped_previous := true;
        END IF;
        INSERT INTO distlock_waiter (id, name, pid) VALUES (queued, p_name, pg_backend_pid());
        -- How many will be handed the lock first: the waiter polls the less often.
        SELECT count(*) INTO ahead FROM distlock_waiter q
         WHERE q.name = p_name AND q.id < queued;
        -- Fewer than p_listeners queued ahead: LISTEN. Else the chain: follow the entry ahead.
        head := ahead < p_listeners OR distlock_ahead(p_name, queued) IS NULL;
        IF head THEN
            EXECUTE format('LISTEN %I', 'distlock_w' || pg_backend_pid());
        ELSIF NOT p_first THEN
            EXECUTE format('UNLISTEN %I', 'distlock_w' || pg_backend_pid());
        END IF;

    SELECT * INTO r FROM distlock_lock l WHERE l.name = p_name FOR SHARE;
    now_us := CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT);
    free := NOT FOUND OR NOT (
        (r.owner <> '' AND r.expires_us > now_us)
        OR (r.reserved_until_us > now_us AND r.reserved_pid <> pg_backend_pid()));

    EXCEPTION WHEN OTHERS OR query_canceled THEN
        -- The block's rollback took back the row, the LISTEN and the settings, but not
        -- the session-level locks: give back each one this call took.
        IF has_entry THEN
            PERFORM pg_advisory_unlock(1684825957, (queued % 2147483648)::integer);
        END IF;
        IF p_previous > 0 AND NOT dropped_previous THEN
            PERFORM pg_advisory_unlock(1684825957, (p_previous % 2147483648)::integer);
        END IF;
        IF has_queued THEN
            PERFORM pg_advisory_unlock_shared(1684825969, hashtext(p_name));
        END IF;
        IF has_alive THEN
            PERFORM pg_advisory_unlock(1684825975, pg_backend_pid());
        END IF;
        IF SQLSTATE NOT IN ('55P03', '57014') THEN
            RAISE;
        END IF;
        queued := 0; free := false; ahead := 0; head := false;
    END;
END
$$;
""",
    "distlock_follow": """
CREATE OR REPLACE FUNCTION distlock_follow(
    p_name text, p_queued bigint, p_wait_ms integer,
    OUT status text, OUT free boolean, OUT moved integer
) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    before bigint;
    until_us bigint :=
        CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT) + p_wait_ms::bigint * 1000;
    left_ms bigint;
    r distlock_lock%ROWTYPE;
    now_us bigint;
    -- The entry whose shared lock this call holds (0: none): never kept past the call.
    holding bigint := 0;
BEGIN
    free := false;
    moved := 0;
    BEGIN
        LOOP
            before := distlock_ahead(p_name, p_queued);
            EXIT WHEN before IS NULL;
            left_ms := ceil(
                (until_us - CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT))
                / 1000.0);
            IF left_ms <= 0 THEN
                status := 'waited';
                RETURN;
            END IF;
            -- For this transaction only (is_local): the session's own setting is back
            -- when the statement ends, whether it succeeded or not.
            PERFORM set_config('lock_timeout', left_ms || 'ms', true);
            -- Set before the wait: PostgreSQL may grant the lock and still raise the
            -- timeout or cancel that came at the same moment.
            holding := before;
            PERFORM pg_advisory_lock_shared(1684825957, (before % 2147483648)::integer);
            PERFORM pg_advisory_unlock_shared(1684825957, (before % 2147483648)::integer);
            holding := 0;
            moved := moved + 1;
            IF current_setting('transaction_isolation') <> 'read committed' THEN
                -- This transaction's snapshot predates the departure (and a FOR SHARE
                -- read of a row changed since would fail): the caller looks again.
                status := 'moved';
                RETURN;
            END IF;
        END LOOP;
        EXECUTE format('LISTEN %I', 'distlock_w' || pg_backend_pid());

    SELECT * INTO r FROM distlock_lock l WHERE l.name = p_name FOR SHARE;
    now_us := CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT);
    free := NOT FOUND OR NOT (
        (r.owner <> '' AND r.expires_us > now_us)
        OR (r.reserved_until_us > now_us AND r.reserved_pid <> pg_backend_pid()));

        -- Its row gone: a release handed it the lock (the notification went unheard).
        status := CASE WHEN EXISTS (SELECT 1 FROM distlock_waiter q WHERE q.id = p_queued)
                       THEN 'head' ELSE 'handed' END;
    EXCEPTION WHEN lock_not_available OR query_canceled THEN
        -- The time ran out (its own lock_timeout, or the session's statement_timeout):
        -- the caller tries at once, and listens only once a later call says so.
        IF holding > 0 AND EXISTS (
            SELECT 1 FROM pg_locks k WHERE k.locktype = 'advisory'
               AND k.pid = pg_backend_pid() AND k.classid = 1684825957
               AND k.objid::bigint = holding % 2147483648 AND k.objsubid = 2
               AND k.mode = 'ShareLock' AND k.granted) THEN
            PERFORM pg_advisory_unlock_shared(1684825957, (holding % 2147483648)::integer);
        END IF;
        status := 'waited';
        free := false;
    END;
END
$$;
""",
    "distlock_leave": """
CREATE OR REPLACE FUNCTION distlock_leave(p_name text, p_queued bigint) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    BEGIN
        DELETE FROM distlock_waiter q WHERE q.name = p_name AND q.pid = pg_backend_pid();
        EXECUTE format('UNLISTEN %I', 'distlock_w' || pg_backend_pid());
        -- Leaving without the grant (timed out, cancelled): hand the reservation on.
        UPDATE distlock_lock l SET reserved_pid = 0, reserved_until_us = 0
         WHERE l.name = p_name AND l.reserved_pid = pg_backend_pid()
           AND l.reserved_until_us > 0;
        IF FOUND THEN
            PERFORM distlock_wake(p_name);
        END IF;
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        -- The pass-on waited too long for the lock row (or failed): the reservation
        -- runs out by itself (the hand-off window). Leave anyway, waiting for nothing.
        DELETE FROM distlock_waiter q WHERE q.id IN (
            SELECT o.id FROM distlock_waiter o
             WHERE o.name = p_name AND o.pid = pg_backend_pid() FOR UPDATE SKIP LOCKED);
        EXECUTE format('UNLISTEN %I', 'distlock_w' || pg_backend_pid());
    END;
    IF current_setting('distlock.checks_client', true) = 'reset' THEN
        RESET client_connection_check_interval;
        RESET distlock.checks_client;
    ELSIF current_setting('distlock.checks_client', true) = 'set' THEN
        PERFORM set_config('client_connection_check_interval', '0', false);
        RESET distlock.checks_client;
    END IF;
    -- Last, when nothing can fail any more: the one behind, woken by the entry's lock,
    -- finds the row gone and any reservation passed on (it waits for this
    -- transaction's row lock to read it).
    PERFORM pg_advisory_unlock_shared(1684825969, hashtext(p_name));
    PERFORM pg_advisory_unlock(1684825975, pg_backend_pid());
    IF p_queued > 0 THEN
        PERFORM pg_advisory_unlock(1684825957, (p_queued % 2147483648)::integer);
    END IF;
END
$$;
""",
}

#: Their argument types, as ``pg_proc`` lists them (an overload is a different function).
ARGUMENTS_1: dict[str, str] = {
    "distlock_channel": "text",
    "distlock_listen": "text",
    "distlock_unlisten": "text",
    "distlock_wake": "text",
    "distlock_holds": "text, text, bigint",
    "distlock_acquire": "text, text, text, bigint, bigint",
    "distlock_renew": "text, text, bigint, bigint",
    "distlock_release": "text, text, bigint, boolean",
    "distlock_queue": "text, boolean",
    "distlock_unqueue": "text",
    "distlock_ahead": "text, bigint",
    "distlock_enqueue": "text, boolean, bigint, integer",
    "distlock_follow": "text, bigint, integer",
    "distlock_leave": "text, bigint",
}


def install_sql(functions: dict[str, str], schema: str) -> str:
    """The statements that install a version: its schema, then its functions."""
    return schema + "".join(sql + "\n" for sql in functions.values())


def drop_sql(arguments: dict[str, str]) -> str:
    """The statements that remove version 1 (functions in reverse order, then the
    schema): what reversing migration 0002 runs."""
    drops = [
        f"DROP FUNCTION IF EXISTS {name}({types});" for name, types in reversed(arguments.items())
    ]
    return "\n".join([
        *drops,
        "DROP TABLE IF EXISTS distlock_waiter;",
        "ALTER TABLE distlock_lock DROP COLUMN IF EXISTS reserved_pid,",
        "    DROP COLUMN IF EXISTS reserved_until_us;",
        "ALTER TABLE distlock_lock RESET (fillfactor);",
    ]) + "\n"


VERSION_1 = install_sql(FUNCTIONS_1, SCHEMA_1)
DROP_1 = drop_sql(ARGUMENTS_1)
