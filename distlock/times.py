"""Database times: integer microseconds since the Unix epoch, by the database clock.

Integers compare the same way on every backend, where SQLite text timestamps and
MariaDB's session time zones would not. These helpers turn them into datetimes for people.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import overload

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@overload
def from_us(value: int) -> datetime: ...
@overload
def from_us(value: None) -> None: ...
@overload
def from_us(value: int | None) -> datetime | None: ...
def from_us(value: int | None) -> datetime | None:
    """Turn database microseconds into an aware UTC datetime (None stays None)."""
    return None if value is None else EPOCH + timedelta(microseconds=value)


# The audit writes "expires <ISO time>" in the detail of every grant and renewal; the
# timeline reads the lease's end back from it.
_EXPIRES = re.compile(r"\bexpires (\d{4}-\d\d-\d\dT[\d:.]+(?:[+-]\d\d:\d\d|Z)?)")


def expiry_detail(expires_at: datetime) -> str:
    """The ``expires …`` text the audit puts in grant and renewal events' detail."""
    return f"expires {expires_at.isoformat()}"


def expiry_in(detail: str) -> int | None:
    """The lease end written by :func:`expiry_detail`, in epoch microseconds, or None."""
    found = _EXPIRES.search(detail or "")
    if found is None:
        return None
    try:
        moment = datetime.fromisoformat(found.group(1))
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return to_us(moment)


def to_us(moment: datetime) -> int:
    """An aware datetime in epoch microseconds, exactly (no float on the way)."""
    delta = moment - EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
