"""raise_tokens(): the step after a failover to a standby that may have missed commits.

With asynchronous replication the primary tells a client "granted, token 41" before the
standby has that commit. If the primary dies then and the standby is promoted, the
standby's lock row still says 40, and its next grant is 41 again: two holders with one
token, and a resource fenced by tokens outside this database cannot tell them apart.
(Inside the database the lost grant's writes were lost with it; that is replication's
matter, not the lock's.) :func:`raise_tokens`, run on the promoted server before the
application reaches it, puts every lock's next token, and every new name's first one,
above anything the lost primary can have issued. ``manage.py distlock_failover`` is its
command; docs/deployment.md has the runbook.

:func:`follow_timeline` makes the step needless on PostgreSQL: every new session compares
the server's timeline, which a promotion advances, with the one the token floor recorded,
and the first session on a promoted standby runs the step itself (docs/decisions.md).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from distlock import db, signals
from distlock.backends import supported
from distlock.conf import conf
from distlock.core import uncommitted
from distlock.validation import check_text, check_token_range, check_using

logger = logging.getLogger("distlock.ops.failover")

#: The default margin: more grants than the lost primary can have made that the standby
#: never received. One name is granted at most a few thousand times a second (one commit
#: each; docs/performance.md), a whole table a few tens of thousands: a billion covers
#: hours of replication lag at those rates, and 2**63 leaves room for nine billion steps.
DEFAULT_MARGIN = 1_000_000_000


@dataclass(frozen=True)
class RaisedTokens:
    """What :func:`raise_tokens` did."""

    #: The largest token the database had (lock rows and the floor) before the step.
    previous: int
    #: Every lock row's token and the floor now: each next grant is above it.
    floor: int
    #: Lock rows changed (all of them).
    rows: int
    #: Leases that were held, now ended: (name, owner, token, holder).
    ended: tuple[tuple[str, str, int, str], ...]


def check_margin(margin: object) -> int:
    """Return ``margin`` if it is a whole number from 1 to MAX_TOKEN."""
    return check_token_range(margin, "margin")


def raise_tokens(
    *, margin: int = DEFAULT_MARGIN, using: str | None = None, by: str = ""
) -> RaisedTokens:
    """After a failover: set every lock's token and the token floor to the largest token
    so far plus ``margin``, and end every lease, in one transaction.

    Every grant from then on gets a token above every token the old primary can have
    issued, provided ``margin`` exceeds the number of grants it made that never reached
    this database (its grant rate times the replication lag at the failure; see
    DEFAULT_MARGIN). Every lease is ended, because the old primary may have ended it
    and granted the name again: holders find out at their next renewal (LockLost) or
    fenced write (StaleToken), and ``lock_broken`` is sent for each, with ``by``. Fenced
    rows need no change: they refuse only tokens lower than theirs, and every new token
    is higher than any the old primary issued. Run it on the promoted server before the
    application can reach it: a grant made there before the step may repeat a lost token.

    Raises TypeError/ValueError for a bad ``margin``, ``using`` or ``by``, and
    TokenExhausted if the tokens would pass 2**63 - 1; nothing is changed then.
    """
    check_text(by, "by")
    margin = check_margin(margin)
    alias = check_using(using)
    uncommitted.refuse_if_holding(None, alias, "raising the fencing tokens")
    previous, floor, rows, ended = db.run(alias, "raise_tokens", margin)
    for name, owner, token, holder in ended:
        signals.lock_broken.send(
            sender=None, name=name, owner=owner, token=token, holder=holder, using=alias,
            by=by,
        )
    return RaisedTokens(previous, floor, rows, tuple(ended))


def follow_timeline(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """The ``connection_created`` receiver: failover with no operator step.

    On PostgreSQL, a session whose server is on another timeline than the token floor
    recorded — a promoted standby, which may lack the last grants of the primary it
    replaces — runs :func:`raise_tokens`' SQL (every token and the floor + DEFAULT_MARGIN,
    every lease ended) and records the server's timeline, in one transaction under the
    floor row's lock: the first session there does it, the others find it recorded. Then
    ``lock_broken`` is sent for each lease ended, by "failover to timeline N", and a
    WARNING logged. Every write on a promoted server runs on a session opened after the
    promotion (a promotion ends every session of the old primary), so nothing is granted
    there before the raise. One statement per new session, nothing per lock operation.
    ``DISTLOCK_FOLLOW_TIMELINE = False`` turns it off (then run ``distlock_failover``).
    Elsewhere (SQLite, MariaDB, a standby's read-only sessions) it does nothing.
    """
    backend = supported(connection)
    if backend is None or not conf.FOLLOW_TIMELINE:
        return
    try:
        followed = backend.follow_timeline(connection, DEFAULT_MARGIN)
    except BaseException:
        # Not left open unchecked: Django would hand this session out at the next query
        # (connect() assigned it before this signal) and nothing would check it again.
        # Closed, the next query connects anew, and checks again.
        with contextlib.suppress(Exception):
            connection.close()
        raise
    if followed is None:
        return
    timeline, raised = followed
    if raised is None:
        logger.info("distlock: recorded timeline %s of database %r", timeline, connection.alias)
        return
    previous, floor, rows, ended = raised
    by = f"failover to timeline {timeline}"
    logger.warning(
        "distlock: database %r is on timeline %s, not the one its token floor recorded "
        "(a promoted standby): every fencing token raised from %s to %s (%s lock rows), "
        "%s held lease(s) ended", connection.alias, timeline, previous, floor, rows, len(ended),
    )
    for name, owner, token, holder in ended:
        signals.lock_broken.send(
            sender=None, name=name, owner=owner, token=token, holder=holder,
            using=connection.alias, by=by,
        )
