"""PostgreSQL: a free lock's grant and every release run fewer statements on the server.

Measured (docs/performance.md, "Fewer statements in the functions"): with 8 processes
on their own names the database's CPU, not the client's, decides the rate, and
``distlock_acquire`` + ``distlock_release`` cost the server about 2–3× A's one-statement
cycle. Each statement inside a PL/pgSQL function pays an executor start and end of its
own (≈ 12 % of the backend's samples in ``perf``), so:

- ``distlock_acquire`` takes the row lock first when the row *looks* free (released,
  expired, not reserved for another session): the ``FOR UPDATE`` read carries that
  condition, so a row that looks held fails it and is not locked — a refusal still
  writes nothing. A free lock's grant is then two statements (the locking read, the
  UPDATE) instead of three (a look, the locking read, the UPDATE); a refusal is two reads
  instead of one, both without a row lock. Everything is decided as before after the row
  lock, with the clock read again after it: the condition only chooses which read comes
  first (a row that changed while the read waited for its lock is re-checked by
  PostgreSQL against its new version, clock included).
- ``distlock_release`` tries the two waiter keys itself (``dlck`` and ``dlcq``, the
  advisory locks that say someone listens or is queued, see 0002 and 0007) and calls
  ``distlock_wake`` only when one of them is taken: with nobody waiting a release no
  longer pays a nested PL/pgSQL call. ``distlock_wake`` takes the same keys again, which
  a transaction-level advisory lock allows (it is re-entrant), so what it decides is
  unchanged.

Reversed: 0007's ``distlock_acquire`` and 0002's ``distlock_release``.
"""

from django.db import migrations

from distlock.migrations._postgresql import (
    ACQUIRE_0007,
    NOW_US,
    RELEASE_0002,
    run_on_postgresql,
)

# The refusals of a lock held or reserved for another session, after the look (the read
# without the row lock) into ``r`` and the clock into ``now_us`` (the same as 0007's).
_BUSY = """
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
"""
_BUSY_STEPS = _BUSY.strip("\n")

# 0003's first use of a name (the token floor), unchanged.
_FIRST_USE_START = "            -- (0003) First use of the name"
_FIRST_USE_END = "        END IF;\n    END LOOP;"
assert ACQUIRE_0007.count(_FIRST_USE_START) == 1 and ACQUIRE_0007.count(_FIRST_USE_END) == 1
_FIRST_USE = ACQUIRE_0007[
    ACQUIRE_0007.index(_FIRST_USE_START):ACQUIRE_0007.index(_FIRST_USE_END)
]

ACQUIRE = f"""
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
        -- (0010) Lock the row at once if it looks free: a free lock's grant is then
        -- this read and the UPDATE. A row that looks held or reserved for another
        -- session fails the condition and is not locked: a refusal writes nothing.
        SELECT * INTO r FROM distlock_lock l
         WHERE l.name = p_name
           AND (l.owner = '' OR l.expires_us <= {NOW_US})
           AND (l.reserved_until_us <= {NOW_US} OR l.reserved_pid = pg_backend_pid())
           FOR UPDATE;
        IF FOUND THEN
            -- Decide only now that the row lock is held, by the clock read now.
            now_us := {NOW_US};
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
            now_us := {NOW_US};
{_BUSY_STEPS}
            -- Freed between the two reads: start again.
        ELSE
{_FIRST_USE.rstrip()}
        END IF;
    END LOOP;
END
$$;
"""

# 0002's release, but for its last step: the wake call only when a waiter key is taken.
_WAKE_0002 = "    PERFORM distlock_wake(p_name);\n"
assert RELEASE_0002.count(_WAKE_0002) == 1, "0002's wake step moved"
RELEASE = RELEASE_0002.replace(_WAKE_0002, """\
    -- (0010) Someone listens (dlck) or is queued (dlcq) only if a key is taken: then
    -- distlock_wake, which takes them again (re-entrant) and decides as before.
    IF NOT (pg_try_advisory_xact_lock(1684825963, hashtext(p_name))
            AND pg_try_advisory_xact_lock(1684825969, hashtext(p_name))) THEN
        PERFORM distlock_wake(p_name);
    END IF;
""")


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0009_postgresql_waiter_chain"),
    ]

    operations = [
        run_on_postgresql(ACQUIRE + RELEASE, ACQUIRE_0007 + RELEASE_0002),
    ]
