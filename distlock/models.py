"""The lock table.

One row per lock name. Times are integers: microseconds since the Unix epoch *by the
database server's clock*, written by SQL expressions that read the server's real-time clock
(see :mod:`distlock.db`). Integers compare the same way on every backend, where SQLite text
timestamps and MariaDB's session time zones would not.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.validation import MAX_NAME_LENGTH

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def from_us(value: int | None) -> datetime | None:
    """Turn database microseconds into an aware UTC datetime."""
    return None if value is None else EPOCH + timedelta(microseconds=value)


class LockNameField(models.CharField):
    """A CharField that compares exactly on every backend.

    MariaDB's and MySQL's default collations fold case, accents and trailing spaces, which
    would make ``lock``, ``LOCK`` and ``lóck`` one lock; the binary NO PAD collations don't.
    PostgreSQL's and SQLite's default collations already compare exactly.
    """

    def db_parameters(self, connection: BaseDatabaseWrapper) -> dict[str, Any]:
        params = super().db_parameters(connection)
        if connection.vendor == "mysql":
            mariadb = getattr(connection, "mysql_is_mariadb", False)
            params["collation"] = "utf8mb4_nopad_bin" if mariadb else "utf8mb4_0900_bin"
        return params


class Lock(models.Model):
    """A named lock: free, held until ``expires_us``, or expired.

    ``token`` is the fencing token of the latest grant. It only ever goes up: each grant
    sets it to the previous value plus one, and a new row starts above every token in
    the table, so purging idle rows cannot make a name start low again.
    """

    name = LockNameField(max_length=MAX_NAME_LENGTH, primary_key=True)
    token = models.BigIntegerField(default=0, editable=False)
    owner = models.CharField(
        max_length=32, blank=True, default="", editable=False,
        help_text="Random id of the current grant; empty when the lock is free.",
    )
    holder = models.CharField(
        max_length=255, blank=True, default="", editable=False,
        help_text="Who holds it, for people: host, pid, thread, task.",
    )
    acquired_us = models.BigIntegerField(null=True, editable=False)
    renewed_us = models.BigIntegerField(null=True, editable=False)
    expires_us = models.BigIntegerField(
        null=True, editable=False,
        help_text="End of the lease; for a free lock, when it was released.",
    )
    renew_count = models.IntegerField(default=0, editable=False)

    class Meta:
        db_table = "distlock_lock"
        ordering = ["name"]
        permissions = [("break_lock", "Can break locks held by others")]

    def __str__(self) -> str:
        return self.name

    @property
    def acquired_at(self) -> datetime | None:
        return from_us(self.acquired_us)

    @property
    def renewed_at(self) -> datetime | None:
        return from_us(self.renewed_us)

    @property
    def expires_at(self) -> datetime | None:
        return from_us(self.expires_us)

    @property
    def is_free(self) -> bool:
        return not self.owner
