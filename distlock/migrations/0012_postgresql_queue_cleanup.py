"""Every step of the wait queue leaves the session clean on every error (PostgreSQL only).

A queued waiter holds *session-level* advisory locks ("alive", "queued", its entry:
migrations 0007 and 0009), which a rollback does not give back. Before this migration an
error inside ``distlock_enqueue`` — its ``FOR SHARE`` read of the lock row cut short by
the session's own ``lock_timeout`` or ``statement_timeout`` while another operation held
the row, a ``pg_cancel_backend()`` — raised to the caller with the three locks still
held, and the session kept them (and the name showed as waited for) until it closed
(issue 27, item 2). ``distlock_leave``'s reservation pass-on could be cut short the same
way, and the caller ignored that error: the same leak on the way out.

Here the three functions of the queue are written out whole (not derived from older
migrations' texts), each with the same rule: the waits inside it are in a block whose
handler gives back every session-level lock the call took, since the block's rollback
does not, and then

- ``distlock_enqueue`` returns ``queued = 0`` when the session's ``lock_timeout`` or
  ``statement_timeout`` (or a cancel) ended its wait: the caller is not queued and waits
  by polling, as a busy try does (README, "Session limits"); any other error is raised
  again after the same clean-up. A call that re-queues (``p_first`` false) gives back its
  previous entry either way; the caller then leaves with ``distlock_leave(name, 0)``.
- ``distlock_follow`` reports such a cut as ``waited`` (the caller tries at once), also
  for a ``statement_timeout`` and for the ``FOR SHARE`` read after the wait, and never
  keeps the shared lock of the entry it waited on — not even when PostgreSQL granted it
  and raised the timeout or cancel of the same moment all the same (then pg_locks says
  so, and the handler gives it back).
- ``distlock_leave`` always leaves: if the reservation pass-on (an UPDATE of the lock
  row, which waits for an operation in flight) is cut short, the reservation is left to
  run out (at most the hand-off window) and the rows, the LISTEN and the locks go anyway.
  It no longer calls ``distlock_unqueue`` (kept for clients of before 0009), so that its
  locks are given back last, after everything that can fail.

Reversed: 0011's ``distlock_enqueue`` and 0009's ``distlock_follow`` and
``distlock_leave``.
"""

from importlib import import_module

from django.db import migrations

from distlock.migrations._postgresql import (
    ALIVE,
    CHAIN_0009,
    CHECK_CLIENT_MS,
    FREE,
    NOW_US,
    QUEUED,
    entry,
    run_on_postgresql,
)

_ENQUEUE_0011 = import_module("distlock.migrations.0011_postgresql_first_waiters_listen").ENQUEUE
_FOLLOW = "CREATE OR REPLACE FUNCTION distlock_follow("
_LEAVE = "CREATE OR REPLACE FUNCTION distlock_leave("
assert CHAIN_0009.count(_FOLLOW) == 1 and CHAIN_0009.count(_LEAVE) == 1
FOLLOW_AND_LEAVE_0009 = CHAIN_0009[CHAIN_0009.index(_FOLLOW):]

# The entry locks' first key (migration 0009); pg_locks shows it as classid.
ENTRY_CLASS = 1684825957

# The errors that end a wait because the session (or an operator) said so:
# lock_not_available (lock_timeout) and query_canceled (statement_timeout, a cancel).
_CUT = "('55P03', '57014')"

# Put client_connection_check_interval back as distlock_enqueue found it (see there).
_RESTORE_CHECKS = """
    IF current_setting('distlock.checks_client', true) = 'reset' THEN
        RESET client_connection_check_interval;
        RESET distlock.checks_client;
    ELSIF current_setting('distlock.checks_client', true) = 'set' THEN
        PERFORM set_config('client_connection_check_interval', '0', false);
        RESET distlock.checks_client;
    END IF;
"""

FUNCTIONS = f"""
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
            PERFORM pg_advisory_lock({ALIVE});
            has_alive := true;
            PERFORM pg_advisory_lock_shared({QUEUED});
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
                PERFORM set_config('client_connection_check_interval', '{CHECK_CLIENT_MS}',
                    false);
            END IF;
        END IF;
        -- The entry lock before the row: a waiter that finds the row finds it held.
        queued := nextval('distlock_waiter_id_seq');
        PERFORM pg_advisory_lock({entry('queued')});
        has_entry := true;
        IF p_previous > 0 THEN
            -- Queueing again (a hand-off it missed): the old entry is given up.
            PERFORM pg_advisory_unlock({entry('p_previous')});
            dropped_previous := true;
        END IF;
        INSERT INTO distlock_waiter (id, name, pid) VALUES (queued, p_name, pg_backend_pid());
        -- How many will be handed the lock first: the waiter polls the less often.
        SELECT count(*) INTO ahead FROM distlock_waiter q
         WHERE q.name = p_name AND q.id < queued;
        -- Fewer than p_listeners queued ahead: LISTEN (0011). Else the chain (0009).
        head := ahead < p_listeners OR distlock_ahead(p_name, queued) IS NULL;
        IF head THEN
            EXECUTE format('LISTEN %I', 'distlock_w' || pg_backend_pid());
        ELSIF NOT p_first THEN
            EXECUTE format('UNLISTEN %I', 'distlock_w' || pg_backend_pid());
        END IF;
        {FREE}
    EXCEPTION WHEN OTHERS OR query_canceled THEN
        -- The block's rollback took back the row, the LISTEN and the settings, but not
        -- the session-level locks: give back each one this call took.
        IF has_entry THEN
            PERFORM pg_advisory_unlock({entry('queued')});
        END IF;
        IF p_previous > 0 AND NOT dropped_previous THEN
            PERFORM pg_advisory_unlock({entry('p_previous')});
        END IF;
        IF has_queued THEN
            PERFORM pg_advisory_unlock_shared({QUEUED});
        END IF;
        IF has_alive THEN
            PERFORM pg_advisory_unlock({ALIVE});
        END IF;
        IF SQLSTATE NOT IN {_CUT} THEN
            RAISE;
        END IF;
        queued := 0; free := false; ahead := 0; head := false;
    END;
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
    -- The entry whose shared lock this call holds (0: none): never kept past the call.
    holding bigint := 0;
BEGIN
    free := false;
    moved := 0;
    BEGIN
        LOOP
            before := distlock_ahead(p_name, p_queued);
            EXIT WHEN before IS NULL;
            left_ms := ceil((until_us - {NOW_US}) / 1000.0);
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
            PERFORM pg_advisory_lock_shared({entry('before')});
            PERFORM pg_advisory_unlock_shared({entry('before')});
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
        {FREE}
        -- Its row gone: a release handed it the lock (the notification went unheard).
        status := CASE WHEN EXISTS (SELECT 1 FROM distlock_waiter q WHERE q.id = p_queued)
                       THEN 'head' ELSE 'handed' END;
    EXCEPTION WHEN lock_not_available OR query_canceled THEN
        -- The time ran out (its own lock_timeout, or the session's statement_timeout):
        -- the caller tries at once, and listens only once a later call says so.
        IF holding > 0 AND EXISTS (
            SELECT 1 FROM pg_locks k WHERE k.locktype = 'advisory'
               AND k.pid = pg_backend_pid() AND k.classid = {ENTRY_CLASS}
               AND k.objid::bigint = holding % 2147483648 AND k.objsubid = 2
               AND k.mode = 'ShareLock' AND k.granted) THEN
            PERFORM pg_advisory_unlock_shared({entry('holding')});
        END IF;
        status := 'waited';
        free := false;
    END;
END
$$;

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
    {_RESTORE_CHECKS.strip()}
    -- Last, when nothing can fail any more: the one behind, woken by the entry's lock,
    -- finds the row gone and any reservation passed on (it waits for this
    -- transaction's row lock to read it).
    PERFORM pg_advisory_unlock_shared({QUEUED});
    PERFORM pg_advisory_unlock({ALIVE});
    IF p_queued > 0 THEN
        PERFORM pg_advisory_unlock({entry('p_queued')});
    END IF;
END
$$;
"""

BACKWARDS = _ENQUEUE_0011 + FOLLOW_AND_LEAVE_0009


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0011_postgresql_first_waiters_listen"),
    ]

    operations = [
        run_on_postgresql(FUNCTIONS, BACKWARDS),
    ]
