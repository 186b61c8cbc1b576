"""Hand-off to the oldest waiter on PostgreSQL (a no-op on other databases).

Before this migration every waiting session LISTENed on the lock's channel and each
release NOTIFYed it: with 64 waiting processes a release woke all 64, they raced to the
row, and the releasing process, already running, often won again (docs/performance.md,
"Hand-off to the oldest waiter").

Now a blocking sync acquire queues (``distlock_queue``, which also says whether the lock
is worth a try at once and how many are ahead): a row in ``distlock_waiter``
(unlogged: a registration is worth nothing after a crash), LISTEN on its session's own
channel ``distlock_w<pid>``, a shared advisory lock (1684825969 "dlcq", hashtext(name))
that tells releasers someone is queued and the overview who waits, and an exclusive one
(1684825975 "dlcw", pid) that says the session is alive. A release or break
(``distlock_wake``, in its transaction, with the row locked) takes the oldest queued row
whose session is alive (a dead one's advisory lock is gone: its row is deleted), deletes
it, *reserves* the freed lock for that session for a grant window (``reserved_pid``,
``reserved_until_us`` = the database clock + the window) and NOTIFYs only that session,
with the row's id as payload. ``distlock_acquire`` refuses everyone else while the
window is open, as busy (a ``blocking=False`` try too), with the window's rest as the
time left; the reserved session gets a normal grant (token + 1 under the row lock), which
clears the reservation. The window's end frees the lock for anyone, so a dead, paused or
slow waiter holds it up for at most the window. A waiter that leaves the queue without the
grant (timed out, cancelled) passes its reservation on (``distlock_unqueue``).

Sessions that LISTEN on the lock's own channel (``distlock_listen``: the async API's
one connection per event loop, or a client of an older distlock during an upgrade) are
not in the queue: while any listens, a release reserves nothing — it NOTIFYs the oldest
queued waiter and the channel, and everybody races as before — so none of them can be
starved by a queue it is not in.

The window (HANDOFF_WINDOW_US) is decided in docs/decisions.md, from measurements.
"""

from django.db import migrations

from distlock.migrations._postgresql import (
    ACQUIRE_0003,
    ACQUIRE_0007,
    ALIVE,
    HANDOFF_WINDOW_US,
    NOW_US,
    QUEUED,
    run_on_postgresql,
)

ACQUIRE = ACQUIRE_0007

FUNCTIONS = f"""
ALTER TABLE distlock_lock
    ADD COLUMN IF NOT EXISTS reserved_pid integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS reserved_until_us bigint NOT NULL DEFAULT 0;

CREATE UNLOGGED TABLE IF NOT EXISTS distlock_waiter (
    id bigserial PRIMARY KEY,
    name text NOT NULL,
    pid integer NOT NULL
);
CREATE INDEX IF NOT EXISTS distlock_waiter_name ON distlock_waiter (name, id);

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
        PERFORM pg_advisory_lock({ALIVE});
        PERFORM pg_advisory_lock_shared({QUEUED});
    END IF;
    INSERT INTO distlock_waiter (name, pid) VALUES (p_name, pg_backend_pid())
    RETURNING id INTO queued;
    -- Is it worth a try now? FOR SHARE waits for a release in flight (it holds the row)
    -- and then reads what it committed; a release after this waits for this transaction,
    -- and then finds the row above. Either way no release goes unseen.
    SELECT * INTO r FROM distlock_lock l WHERE l.name = p_name FOR SHARE;
    now_us := {NOW_US};
    free := NOT FOUND OR NOT (
        (r.owner <> '' AND r.expires_us > now_us)
        OR (r.reserved_until_us > now_us AND r.reserved_pid <> pg_backend_pid()));
    -- How many will be handed the lock first: the waiter polls the less often.
    SELECT count(*) INTO ahead FROM distlock_waiter q WHERE q.name = p_name AND q.id < queued;
END
$$;

CREATE OR REPLACE FUNCTION distlock_unqueue(p_name text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    DELETE FROM distlock_waiter q WHERE q.name = p_name AND q.pid = pg_backend_pid();
    PERFORM pg_advisory_unlock_shared({QUEUED});
    PERFORM pg_advisory_unlock({ALIVE});
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

CREATE OR REPLACE FUNCTION distlock_wake(p_name text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    w distlock_waiter%ROWTYPE;
    broadcast boolean := NOT pg_try_advisory_xact_lock(1684825963, hashtext(p_name));
    now_us bigint;
BEGIN
    IF NOT pg_try_advisory_xact_lock({QUEUED}) THEN
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
                now_us := {NOW_US};
                UPDATE distlock_lock l
                   SET reserved_pid = w.pid, reserved_until_us = now_us + {HANDOFF_WINDOW_US}
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
{ACQUIRE}
"""

# Dropping the columns is instant on PostgreSQL (they are only marked dropped).
DROP = f"""
CREATE OR REPLACE FUNCTION distlock_wake(p_name text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock(1684825963, hashtext(p_name)) THEN
        PERFORM pg_notify(distlock_channel(p_name), '');
    END IF;
END
$$;
DROP FUNCTION IF EXISTS distlock_unqueue(text);
DROP FUNCTION IF EXISTS distlock_queue(text, boolean);
DROP TABLE IF EXISTS distlock_waiter;
{ACQUIRE_0003}
ALTER TABLE distlock_lock DROP COLUMN IF EXISTS reserved_pid,
    DROP COLUMN IF EXISTS reserved_until_us;
"""


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0006_mysql_procedures"),
    ]

    operations = [
        run_on_postgresql(FUNCTIONS, DROP),
    ]
