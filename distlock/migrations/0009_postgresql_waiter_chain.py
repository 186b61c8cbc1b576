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

from distlock.migrations._postgresql import CHAIN_0009, run_on_postgresql

# The SQL is in _postgresql.py: 0011 derives its versions from it.
FUNCTIONS = CHAIN_0009

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
