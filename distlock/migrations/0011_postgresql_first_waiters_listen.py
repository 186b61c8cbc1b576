"""A short queue listens as under 0007; a long one waits in 0009's chain (PostgreSQL only).

0009 made every waiter but the head wait on the entry lock of the one just ahead, so a
NOTIFY signals one or two listening backends however long the queue. It costs a waiter
behind the head one statement more per grant (``distlock_follow``: wait, then LISTEN
and look), which showed with 8 waiters, where a NOTIFY to 8 listeners is cheap
(docs/performance.md, "Only the head listens").

Now a waiter that finds fewer than ``p_listeners`` rows queued ahead of it (the count
``distlock_enqueue`` already made for the poll, now made before the choice) LISTENs, as
every waiter did under 0007; one that finds that many waits in 0009's chain, behind the
live entry just ahead, and LISTENs when it becomes the head. So a queue of up to
``p_listeners`` runs with no chain, and a longer one turns into 0009's chain as it moves:
those who queued early listen until they are served, and each later one waits behind
another until it is the head. ``p_listeners`` is the caller's
(``DISTLOCK_LISTENING_WAITERS``); its default, 1, is 0009's rule (listen with nobody
live ahead), so a client of before this migration, which passes three arguments, waits
as it did. Nothing else changes: ``distlock_ahead``, ``distlock_follow`` and
``distlock_leave`` are 0009's, and a waiter that waits behind another is one of 0009's.

``distlock_enqueue`` is 0009's with that change (derived from its text in
_postgresql.py), and replaces it (pg_proc keeps one of each). Reversed: 0009's.
"""

from django.db import migrations

from distlock.migrations._postgresql import CHAIN_0009, run_on_postgresql

_START = "CREATE OR REPLACE FUNCTION distlock_enqueue("
_END = "CREATE OR REPLACE FUNCTION distlock_follow("
assert CHAIN_0009.count(_START) == 1 and CHAIN_0009.count(_END) == 1
ENQUEUE_0009 = CHAIN_0009[CHAIN_0009.index(_START):CHAIN_0009.index(_END)]

_COUNT = """
    -- How many will be handed the lock first: the waiter polls the less often.
    SELECT count(*) INTO ahead FROM distlock_waiter q WHERE q.name = p_name AND q.id < queued;
"""
_HEAD = "    head := distlock_ahead(p_name, queued) IS NULL;\n"


def _changed(sql: str, *steps: tuple[str, str]) -> str:
    """``sql`` with each (old, new) step made; each old text must occur exactly once."""
    for old, new in steps:
        assert sql.count(old) == 1, f"0009's distlock_enqueue changed: {old!r}"
        sql = sql.replace(old, new)
    return sql


ENQUEUE = _changed(
    ENQUEUE_0009,
    ("    p_name text, p_first boolean, p_previous bigint,\n",
     "    p_name text, p_first boolean, p_previous bigint, p_listeners integer DEFAULT 1,\n"),
    (_COUNT, ""),
    (_HEAD, _COUNT.lstrip("\n") + """\
    -- (0011) Fewer than p_listeners queued ahead: LISTEN, as under 0007. Else the chain.
    head := ahead < p_listeners OR distlock_ahead(p_name, queued) IS NULL;
"""),
)

DROP_0009 = "DROP FUNCTION IF EXISTS distlock_enqueue(text, boolean, bigint);\n"
DROP = "DROP FUNCTION IF EXISTS distlock_enqueue(text, boolean, bigint, integer);\n"


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0010_postgresql_fewer_statements"),
    ]

    operations = [
        run_on_postgresql(DROP_0009 + ENQUEUE, DROP + ENQUEUE_0009),
    ]
