"""Waking blocking acquires when the lock is freed: LISTEN/NOTIFY on PostgreSQL.

A blocking ``acquire()`` that is refused waits before its next try. On PostgreSQL (with
psycopg 3 and ``DISTLOCK_WAKEUPS`` on) it first registers on its own connection to the
lock's database (``distlock_listen``: LISTEN on the lock's channel and a shared advisory
lock that tells releasers someone waits), tries once more at once (the lock may have
been freed before the LISTEN), and then waits for a notification *or* the usual back-off
pause, whichever comes first. Releases and breaks notify only when someone waits. So a
waiter gets a freed lock one round trip after the release instead of after its pause,
and the polling stays as the fallback: for expiry (nobody notifies when a holder dies)
and for anything that went wrong with a notification.

Elsewhere (MariaDB, SQLite, psycopg 2, wake-ups off) waiting is a plain sleep.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from django.db import DatabaseError, connections

from distlock import db
from distlock.backends import backend_for
from distlock.conf import conf


class Waiter:
    """The waiting of one blocking acquire of ``name`` on database ``alias``."""

    def __init__(self, alias: str, name: str) -> None:
        self.alias = alias
        self.name = name
        self.connection = connections[alias]
        self.raw: Any = None
        self.backend = backend_for(self.connection)
        if conf.WAKEUPS and self.backend.supports_wakeups():
            db.run(alias, "listen", name)
            self.raw = self.connection.connection

    @property
    def listening(self) -> bool:
        """True while a notification can wake this waiter (a reconnect drops the LISTEN)."""
        return self.raw is not None and self.raw is self.connection.connection

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``; return early when the lock's release is announced."""
        if not self.listening:
            time.sleep(seconds)
            return
        self.backend.wait_for_wakeup(self.connection, seconds)

    def stop(self) -> None:
        """Stop listening (the acquire got the lock, gave up or failed)."""
        if self.listening:
            # A connection that broke meanwhile dropped the LISTEN and the advisory lock
            # with its session; the next operation replaces it.
            with contextlib.suppress(DatabaseError):
                db.run(self.alias, "unlisten", self.name)
        self.raw = None
