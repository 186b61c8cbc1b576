"""Database times: integer microseconds since the Unix epoch, by the database clock.

Integers compare the same way on every backend, where SQLite text timestamps and
MariaDB's session time zones would not. These helpers turn them into datetimes for people.
"""

from __future__ import annotations

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
