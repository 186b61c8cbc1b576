"""Server-side lock operations for PostgreSQL (a no-op on other databases).

Each function is defined here once, in its final form; the reverse drops them all.

**One statement per operation.** ``distlock_acquire``, ``distlock_renew`` and
``distlock_release`` do what distlock.db does in Python — the locking read, the decision
and the update — inside one statement, so an operation costs one round trip and one
commit instead of BEGIN, three or four statements and COMMIT. The semantics are the same:
``SELECT … FOR UPDATE`` before any change, and every time comparison reads
``clock_timestamp()`` after the row lock is held (never ``now()``, which is frozen at the
start of the transaction). A try on a lock that a committed, unexpired lease holds is
refused by a plain read, without taking the row lock: that writes nothing, so a refusal
needs no WAL flush and does not queue behind the holder's row lock. It is a correct
refusal: at the instant of that read the lock was held by the database clock.

**Wake-ups (LISTEN/NOTIFY).** A blocking acquire that was refused calls
``distlock_listen``: LISTEN on the lock's channel, then a *shared* session advisory lock
on the lock's key. A release or a break calls ``distlock_wake``: if it cannot take that
key exclusively, someone is waiting, and it NOTIFYs the channel, delivered at commit.
With nobody waiting nothing is sent, so an uncontended release does not pay NOTIFY's
commit-time serialization. The key is (1684825963 = "dlck", hashtext(name)); a hash
collision only wakes a waiter early, and a lost notification only leaves the waiter to
its back-off poll. See distlock/waiting/queue.py.

**Releases need not wait for the disk.** ``p_durable`` false sets
``synchronous_commit = off`` for the release's own transaction. Only releases: a grant or
a renewal lost in a crash would hand out a token twice or let a holder outlive the lease
it was told it had, but a release lost in a crash only leaves the lock held by the lease
that released it until that lease expires — what a holder that crashed without releasing
does anyway. Every later durable commit (the next grant among them) flushes the WAL up to
and including the release, so no grant that survives a crash can come after a release
that did not. ``durable`` tells which kind of commit this release made. See
DISTLOCK_DURABLE_RELEASE in the README.

**The fenced write's ownership check.** ``distlock_holds(name, owner, token)`` is the
locking read of ``distlock.fencing``'s ownership check — the lock row with this owner and
token, unexpired by ``clock_timestamp()``, share-locked until the transaction ends. A
fenced UPDATE carries it as ``(SELECT distlock_holds(…))``: an uncorrelated sub-select,
which PostgreSQL runs once, before the first row is written. A PL/pgSQL function keeps
its statement's plan for the session, where an inline sub-select would be parsed and
planned again with every write.

``fillfactor`` leaves room on each page so that the frequent updates of a lock row
(grants, renewals, releases change no indexed column) can stay heap-only (HOT).

This migration replaces the pre-release series 0003–0007, which defined the same functions
step by step: a database that applied all of those counts it as applied.
"""

from django.db import migrations

from distlock.migrations._postgresql import (
    ACQUIRE_0002,
    NOW_US,
    RELEASE_0002,
    run_on_postgresql,
)

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
{ACQUIRE_0002}
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
{RELEASE_0002}
CREATE OR REPLACE FUNCTION distlock_holds(p_name text, p_owner text, p_token bigint)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM distlock_lock l
     WHERE l.name = p_name AND l.owner = p_owner AND l.token = p_token
       AND l.expires_us > {NOW_US}
       FOR SHARE;
    RETURN FOUND;
END
$$;

ALTER TABLE distlock_lock SET (fillfactor = 70);
"""

DROP = """
ALTER TABLE distlock_lock RESET (fillfactor);
DROP FUNCTION IF EXISTS distlock_holds(text, text, bigint);
DROP FUNCTION IF EXISTS distlock_release(text, text, bigint, boolean);
DROP FUNCTION IF EXISTS distlock_renew(text, text, bigint, bigint);
DROP FUNCTION IF EXISTS distlock_acquire(text, text, text, bigint, bigint);
DROP FUNCTION IF EXISTS distlock_wake(text);
DROP FUNCTION IF EXISTS distlock_unlisten(text);
DROP FUNCTION IF EXISTS distlock_listen(text);
DROP FUNCTION IF EXISTS distlock_channel(text);
"""


class Migration(migrations.Migration):

    # The pre-release steps this migration squashes (0004 made the LockEvent table,
    # which 0001_initial makes now). See CHANGELOG.md, 0.1.0.
    replaces = [
        ("distlock", "0003_postgresql_functions"),
        ("distlock", "0004_lockevent"),
        ("distlock", "0005_postgresql_wakeups"),
        ("distlock", "0006_postgresql_release_commit"),
        ("distlock", "0007_postgresql_fence_check"),
    ]

    dependencies = [
        ("distlock", "0001_initial"),
    ]

    operations = [
        run_on_postgresql(FUNCTIONS, DROP),
    ]
