"""The lock table.

One row per lock name. Times are integers: microseconds since the Unix epoch *by the
database server's clock*, written by SQL expressions that read the server's real-time clock
(see :mod:`distlock.db`). Integers compare the same way on every backend, where SQLite text
timestamps and MariaDB's session time zones would not.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import models
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends import supported
from distlock.constants import (
    EVENT_TABLE,
    FLOOR_ID,
    FLOOR_TABLE,
    HOLDER_LENGTH,
    LOCK_TABLE,
    MAX_NAME_LENGTH,
    OWNER_LENGTH,
    TASK_KEY_TABLE,
)
from distlock.times import from_us

if TYPE_CHECKING:
    _CharField = models.CharField[str, str]
else:  # CharField is not subscriptable at run time without django-stubs-ext's patch.
    _CharField = models.CharField


class LockNameField(_CharField):
    """A CharField that compares exactly on every backend.

    MariaDB's and MySQL's default collations fold case, accents and trailing spaces, which
    would make ``lock``, ``LOCK`` and ``lóck`` one lock; the binary NO PAD collations don't.
    PostgreSQL's and SQLite's default collations already compare exactly.
    """

    def db_parameters(self, connection: BaseDatabaseWrapper) -> dict[str, Any]:
        params = super().db_parameters(connection)
        backend = supported(connection)
        collation = None if backend is None else backend.name_field_collation(connection)
        if collation is not None:
            params["collation"] = collation
        return params


class Lock(models.Model):
    """A named lock: free, held until ``expires_us``, or expired.

    ``token`` is the fencing token of the latest grant. It only ever goes up: each grant
    sets it to the previous value plus one, and a new row starts above the
    :class:`TokenFloor`, which purging raises to every token it deletes, so a purged name
    that comes back cannot start low again.
    """

    name = LockNameField(max_length=MAX_NAME_LENGTH, primary_key=True)
    token = models.BigIntegerField(default=0, editable=False)
    owner = models.CharField(
        max_length=OWNER_LENGTH, blank=True, default="", editable=False,
        help_text="Random id of the current grant; empty when the lock is free.",
    )
    holder = models.CharField(
        max_length=HOLDER_LENGTH, blank=True, default="", editable=False,
        help_text="Who holds it, for people: host, pid, thread, task.",
    )
    acquired_us = models.BigIntegerField(null=True, editable=False)
    renewed_us = models.BigIntegerField(null=True, editable=False)
    expires_us = models.BigIntegerField(
        null=True, editable=False,
        help_text="End of the lease; for a free lock, when it was released.",
    )
    renew_count = models.IntegerField(default=0, editable=False)

    # Migration 0001 indexes the owned rows (held or expired) for "which locks are held
    # now"; each vendor's form is in distlock/backends/ (MariaDB has no partial index),
    # so the index is not in Meta.indexes, where Django would warn on MariaDB.

    class Meta:
        db_table = LOCK_TABLE
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


class TokenFloor(models.Model):
    """One row (id 1): no purged lock row ever had a token above ``token``.

    ``purge_locks()`` raises it to the largest token it deletes, in the deleting
    transaction, and a new lock row starts at ``token + 1``: the first use of a name reads
    one row instead of the largest token of the whole lock table (a full scan, since
    ``token`` has no index; an index would end the heap-only updates of every grant).
    Migration 0001 makes it, at 0. If the row is missing
    (a ``flush``), the next first use or purge puts it back from the same maximum.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=FLOOR_ID, editable=False)
    token = models.BigIntegerField(default=0, editable=False)
    #: PostgreSQL: the server timeline the tokens were last raised for (or first seen on;
    #: migration 0004 records it). A session on a server with another timeline — a
    #: promoted standby — raises every token first (distlock.ops.failover.follow_timeline).
    timeline = models.BigIntegerField(null=True, editable=False)

    class Meta:
        db_table = FLOOR_TABLE
        verbose_name = "token floor"

    def __str__(self) -> str:
        return f"token floor {self.token}"


class LockEvent(models.Model):
    """One entry of the audit history (recorded when ``DISTLOCK_AUDIT`` is on).

    ``at_us`` is the database clock, like the lock table's times, so events line up with
    the grants and expiries they describe even when app servers' clocks disagree.
    """

    class Kind(models.TextChoices):
        ACQUIRED = "acquired", "acquired"
        TOOK_OVER = "took_over", "expired take-over"
        RENEWED = "renewed", "renewed"
        RELEASED = "released", "released"
        BROKEN = "broken", "broken"
        LOST = "lost", "lost"
        STALE_WRITE = "stale_write", "stale write refused"

    at_us = models.BigIntegerField(db_index=True, editable=False)
    kind = models.CharField(max_length=16, choices=Kind.choices, editable=False)
    # Indexed with at_us (Meta.indexes), which also serves lookups by name alone.
    name = LockNameField(max_length=MAX_NAME_LENGTH, editable=False)
    token = models.BigIntegerField(null=True, editable=False)
    owner = models.CharField(max_length=OWNER_LENGTH, blank=True, default="", editable=False)
    holder = models.CharField(max_length=HOLDER_LENGTH, blank=True, default="", editable=False)
    by = models.CharField(
        max_length=HOLDER_LENGTH, blank=True, default="", editable=False,
        help_text="Who broke the lock (user name or command), for broken locks.",
    )
    detail = models.CharField(max_length=500, blank=True, default="", editable=False)

    class Meta:
        db_table = EVENT_TABLE
        ordering = ["-at_us", "-id"]
        verbose_name = "lock event"
        # "The newest events of these locks" (the timeline, a lock's history) reads only
        # them; with an index on name alone it read every event the lock ever had (a busy
        # lock: a million rows, 0.4 s; benchmarks/timeline.py). It replaces that index, so
        # an audit insert maintains as many indexes as before.
        indexes = [models.Index(fields=["name", "at_us"], name="distlock_event_name_at")]

    def __str__(self) -> str:
        return f"{self.name} {self.kind} (token {self.token})"

    @property
    def at(self) -> datetime | None:
        return from_us(self.at_us)


class TaskKey(models.Model):
    """The uniqueness key of :func:`distlock.celery.enqueue_once`: one row per key
    (``name``, compared exactly as lock names are).

    Two slots, each ending by the database clock: the *queued* slot (a task of the key is
    sent and has not started, until ``queued_until_us``) and the *running* slot (a run of
    it is in its body, until ``running_until_us``). A worker killed mid-run leaves its
    slot behind; it stops counting at its end, so no key is blocked past its ttl.
    ``generation`` grows by one with each send, from the database clock (µs) when the row
    was made, so a key purged and enqueued again never repeats an old message's: a
    debounced run that is not the latest skips.
    """

    name = LockNameField(max_length=MAX_NAME_LENGTH, primary_key=True, editable=False)
    task = models.CharField(max_length=HOLDER_LENGTH, blank=True, default="", editable=False)
    policy = models.CharField(max_length=32, default="queued", editable=False)
    generation = models.BigIntegerField(default=0, editable=False)
    ttl_us = models.BigIntegerField(default=0, editable=False)
    enqueued_us = models.BigIntegerField(null=True, editable=False)
    queued_until_us = models.BigIntegerField(
        null=True, editable=False,
        help_text="End of the queued slot: a task is sent and has not started.",
    )
    running_until_us = models.BigIntegerField(
        null=True, editable=False, help_text="End of the running slot: a run is in its body.",
    )
    running_owner = models.CharField(
        max_length=OWNER_LENGTH, blank=True, default="", editable=False,
        help_text="Random id of the run in the running slot.",
    )
    started_us = models.BigIntegerField(null=True, editable=False)
    waiting_us = models.BigIntegerField(
        null=True, editable=False,
        help_text="Since when a queued run waits in its worker for the running slot.",
    )

    class Meta:
        db_table = TASK_KEY_TABLE
        ordering = ["name"]
        verbose_name = "task key"

    def __str__(self) -> str:
        return self.name

    @property
    def enqueued_at(self) -> datetime | None:
        return from_us(self.enqueued_us)

    @property
    def queued_until(self) -> datetime | None:
        return from_us(self.queued_until_us)

    @property
    def running_until(self) -> datetime | None:
        return from_us(self.running_until_us)


# The abstract fenced model lives beside its querysets; it is importable from here too.
from distlock.fencing import FencedModel as FencedModel  # noqa: E402
