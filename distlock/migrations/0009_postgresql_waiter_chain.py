"""Only the head of a name's queue LISTENs; the others wait in a chain (PostgreSQL only).

With 0007 every queued waiter LISTENed on its session's own channel. The hand-off
NOTIFYs one of them, but PostgreSQL (15, and every version before 19) signals *every*
listening backend of the database on each NOTIFY, whatever its channel, and each one
wakes up to read the notification queue: with 64 waiters a hand-off cost 590 µs of the
listeners' CPU against 80 with 8 (docs/performance.md, "Only the head listens").

Now a waiter takes an exclusive advisory lock on its queue entry (1684825957 "dlce",
the entry's id modulo 2**31) before its row becomes visible, and holds it until it
leaves the queue (granted, gave up, or its session ended). A waiter with a live entry
ahead of it does not LISTEN: it blocks on a *shared* lock of the nearest such entry
(``distlock_follow``, with ``lock_timeout`` set for that transaction only from the time
it may wait) and, when that returns, looks again. PostgreSQL's lock manager wakes just
the one session queued on a lock, so each departure wakes one waiter. A waiter with no
live entry ahead is the head: it LISTENs and, in the same transaction, reads the lock
row FOR SHARE — LISTEN first, then the check, then the wait — so a hand-off is either
seen by that read (a release in flight holds the row; the read waits and sees its
reservation) or comes after the LISTEN (a release after the read waits for this
transaction). Whatever the queue's length, one or two sessions listen per name.

Entries ahead whose advisory lock can be had at once are skipped: their session ended
(the release's ``distlock_wake`` deletes such rows when it reaches them), or they were
queued by a client of before this migration (``distlock_queue``, kept unchanged for
it, with ``distlock_unqueue``; such a waiter still LISTENs, and is handed the lock in
its turn). Waits on entry locks go strictly towards older entries, so they cannot form a
cycle; a session that queues again gets a new entry, never the old one's key.

``distlock_wake`` is unchanged: it hands the lock to the oldest queued row whose
session is alive (the 0007 "alive" lock, still taken on the first queueing).
"""

from django.db import migrations

from distlock.migrations._postgresql import NOW_US, run_on_postgresql

ALIVE = "1684825975, pg_backend_pid()"
QUEUED = "1684825969, hashtext(p_name)"


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

FUNCTIONS = f"""
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

DROP = """
DROP FUNCTION IF EXISTS distlock_leave(text, bigint);
DROP FUNCTION IF EXISTS distlock_follow(text, bigint, integer);
DROP FUNCTION IF EXISTS distlock_enqueue(text, boolean, bigint);
DROP FUNCTION IF EXISTS distlock_ahead(text, bigint);
"""


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0008_lockevent_rare_index"),
    ]

    operations = [
        run_on_postgresql(FUNCTIONS, DROP),
    ]
