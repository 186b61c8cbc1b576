"""The lease policies' SQL (distlock/core/policies.py) and their part of the holder text:
portable, a base of :class:`~distlock.backends.base.Backend`, kept apart because it is one
concern of its own. The holder text's part lives here because a break reads it.

Only grants made with a policy run these; every grant path stays as it was. Each operation
is the usual shape (:mod:`distlock.backends.base`): the row locked first, then a
conditional UPDATE whose clock is read after that, by the database.
"""

from __future__ import annotations

import re
from typing import Any

from distlock.backends.results import RENEW_REFUSED, Grant
from distlock.constants import HOLDER_LENGTH
from distlock.constants import LOCK_TABLE as TABLE

#: The owner of a row in a lock-delay after a break: not 32 hex digits, so no lease's owner
#: (check_owner refuses it), and never empty, so the row counts as held until it ends.
DELAY_OWNER = "lock-delay"

#: Why a renewal past ``acquired + max_hold`` is refused (LockLost's reason).
MAX_HOLD_REFUSED = "it reached its max_hold"

# The holder text's prefix: "[min_hold=5s max_hold=60s lock_delay=2s] ".
_PREFIX = re.compile(r"\[((?:(?:min_hold|max_hold|lock_delay)=[0-9.e+-]+s ?)+)\] ")


def seconds_text(seconds: float) -> str:
    """``5`` -> ``"5s"``, ``0.25`` -> ``"0.25s"``: exact to the microsecond, read back by
    :func:`named`."""
    return f"{round(seconds, 6):.15g}s"


def named(holder: str) -> dict[str, float]:
    """The policies a holder text names at its start (``{}``: none)."""
    if not holder.startswith("["):
        return {}
    match = _PREFIX.match(holder)
    if match is None:
        return {}
    found: dict[str, float] = {}
    for part in match.group(1).split():
        key, _, value = part.partition("=")
        try:
            found[key] = float(value[:-1])
        except ValueError:
            continue
    return found


def delay_after_break(owner: str, holder: str) -> int:
    """The lock-delay (µs) a break of this grant starts: its own ``lock_delay``, if any.

    A row already in a lock-delay after a break is freed at once by another break: that
    is how an operator ends a delay early.
    """
    if owner == DELAY_OWNER:
        return 0
    delay = named(holder).get("lock_delay")
    return 0 if delay is None else round(delay * 1e6)



class PolicySQL:
    """``renew_within``, ``keep_until_min_hold`` and the lock-delay of a break."""

    def now_sql(self) -> str:
        raise NotImplementedError

    def now(self, cursor: Any) -> int:
        raise NotImplementedError

    def lock_row(self, cursor: Any, name: str) -> Any:
        raise NotImplementedError

    def update_row(
        self, cursor: Any, name: str, changes: str, condition: str, params: list[Any], *,
        returning: str,
    ) -> Any:
        raise NotImplementedError

    def renew_within(
        self, cursor: Any, name: str, owner: str, token: int, ttl_us: int,
        max_hold_us: int, delay_us: int,
    ) -> Grant | str:
        """Renew (owner, token) to ``now + ttl``, but never past ``acquired + max_hold``,
        and not at all from then on; the row's expiry is that plus ``delay_us``."""
        row = self.lock_row(cursor, name)
        if row is None:
            return RENEW_REFUSED["missing"]
        if (row[1], row[0]) != (owner, token):
            return RENEW_REFUSED["changed"]
        renewed = self.update_row(
            cursor, name,
            "renewed_us = {now}, expires_us = CASE WHEN {now} + %s < acquired_us + %s "
            "THEN {now} + %s ELSE acquired_us + %s END + %s, renew_count = renew_count + 1",
            "owner = %s AND token = %s AND expires_us > {now} AND acquired_us + %s > {now}",
            [ttl_us, max_hold_us, ttl_us, max_hold_us, delay_us, owner, token, max_hold_us],
            returning="token, renewed_us, expires_us",
        )
        if renewed is not None:
            return Grant(*renewed)
        cursor.execute(f"SELECT acquired_us FROM {TABLE} WHERE name = %s", [name])
        if int(cursor.fetchone()[0]) + max_hold_us <= self.now(cursor):
            return MAX_HOLD_REFUSED
        return RENEW_REFUSED["expired"]

    def keep_until_min_hold(
        self, cursor: Any, name: str, owner: str, token: int, min_hold_us: int
    ) -> int | None:
        """A release under ``min_hold``: if (owner, token) holds and ``acquired +
        min_hold`` is still ahead, keep the grant until then (owner and token unchanged)
        and return that moment; None: nothing changed (release it the usual way)."""
        row = self.lock_row(cursor, name)
        if row is None or (row[1], row[0]) != (owner, token):
            return None
        kept = self.update_row(
            cursor, name, "expires_us = acquired_us + %s",
            "owner = %s AND token = %s AND expires_us > {now} AND acquired_us + %s > {now}",
            [min_hold_us, owner, token, min_hold_us], returning="expires_us",
        )
        return None if kept is None else int(kept[0])

    def break_into_delay(self, cursor: Any, name: str, token: int, delay_us: int) -> None:
        """Break grant ``token`` of ``name`` into a lock-delay: the row is held by nobody's
        lease (:data:`DELAY_OWNER`) until ``now + delay_us``, so the broken holder's
        renewals and fenced writes fail at once and nobody is granted it before then."""
        holder = f"[lock_delay={seconds_text(delay_us / 1e6)}] after a break"
        cursor.execute(
            f"UPDATE {TABLE} SET owner = %s, holder = %s, "
            f"expires_us = {self.now_sql()} + %s WHERE name = %s AND token = %s",
            [DELAY_OWNER, holder[:HOLDER_LENGTH], delay_us, name, token],
        )
