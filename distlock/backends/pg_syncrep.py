"""PostgreSQL's cancelled synchronous replication wait: a commit reported done that a
failover may lose.

With ``synchronous_standby_names`` set, a COMMIT waits until a standby has the commit.
If that wait is cancelled — ``pg_cancel_backend``, a ``statement_timeout``, a client's
cancel, ``pg_terminate_backend`` — the server cannot undo the commit: it answers with
success and only a WARNING ("canceling wait for synchronous replication due to user
request", "canceling the wait for synchronous replication and terminating connection
due to administrator command"; DETAIL "The transaction has already committed locally,
but might not have been replicated to the standby"). A standby promoted then may not
have it; Patroni's docs say so even for ``synchronous_mode_strict``. A grant reported done
that way may vanish at a failover and its token be issued again.

So every PostgreSQL session gets a notice handler (:func:`watch`, from
``connection_created``) that marks such a WARNING on the Django connection;
:func:`distlock.db.run_on` and the fenced write clear the mark before the operation
(:func:`watching`) and raise :class:`~distlock.exceptions.NotReplicated` when it is set
after the commit (:func:`unreplicated`). psycopg 3 only (psycopg2 has no notice handler
hook; its sessions are not watched). The WARNING is matched on its English text: a server
with another ``lc_messages`` needs ``lc_messages = 'C'`` for distlock's sessions
(docs/deployment.md).
"""

from __future__ import annotations

from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

# Both forms of the WARNING (cancel and terminate) contain this.
_TEXT = "wait for synchronous replication"
_ATTRIBUTE = "_distlock_unreplicated"


class Mark:
    """The last cancelled-wait WARNING of one session since :func:`watching` cleared it."""

    __slots__ = ("warning",)

    def __init__(self) -> None:
        self.warning: str | None = None

    def __call__(self, diagnostic: Any) -> None:
        """psycopg's notice handler: called with each NOTICE/WARNING's diagnostic."""
        message = str(diagnostic.message_primary or "")
        if _TEXT in message and diagnostic.severity_nonlocalized == "WARNING":
            self.warning = message


def watch(connection: BaseDatabaseWrapper) -> None:
    """Mark this new session's cancelled synchronous waits on ``connection``."""
    raw = connection.connection
    if raw is None or not hasattr(raw, "add_notice_handler"):
        return
    mark = Mark()
    raw.add_notice_handler(mark)
    setattr(connection, _ATTRIBUTE, mark)


def watching(connection: BaseDatabaseWrapper) -> None:
    """Forget a WARNING seen before the operation that starts now."""
    mark: Mark | None = connection.__dict__.get(_ATTRIBUTE)
    if mark is not None:
        mark.warning = None


def unreplicated(connection: BaseDatabaseWrapper) -> str | None:
    """The cancelled-wait WARNING seen since :func:`watching`, or None."""
    mark: Mark | None = connection.__dict__.get(_ATTRIBUTE)
    return None if mark is None else mark.warning
