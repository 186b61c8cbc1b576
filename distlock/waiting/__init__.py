"""Waiting for a lock between tries (docs/waiting.md is the design, on one page).

``queue``: a sync acquire's waiting — the turns of one process's threads, and on
PostgreSQL the queue in the database with its hand-off (LISTEN/NOTIFY). ``listener``: the
async API's one LISTEN connection per event loop. Elsewhere waiting is polling, which
:mod:`distlock.core.grants` paces.
"""
