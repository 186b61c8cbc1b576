"""Tables of the stress harness (tests/stress): the protected resource and the ground truth.

Every row here is written inside the same transaction as the operation it records, with
times read from the database clock, so the checker never compares two machines' clocks:

* ``LockHistory`` by triggers on ``distlock_lock`` that the harness installs for a run
  (grants, renewals and ends exactly as the lock table changed, by whatever code path);
* ``Write`` by the worker, in the transaction of its fenced write to ``Resource``.
"""

from __future__ import annotations

from django.db import models

from distlock.models import FencedModel


class Resource(FencedModel):
    """A counter guarded by the lock of the same name: each write adds one."""

    name = models.CharField(max_length=255, primary_key=True)
    value = models.BigIntegerField(default=0)
    version = models.BigIntegerField(default=0)

    fence_name = "{name}"

    def __str__(self) -> str:
        return f"{self.name}={self.value} (v{self.version})"


class LockHistory(models.Model):
    """One change of a lock row, recorded by a trigger: ``grant``, ``renew`` or ``end``.

    ``at_us`` is the grant, renewal or release/break time and ``expires_us`` the expiry
    the change set (for ``end``: the expiry the ended lease had).
    """

    name = models.CharField(max_length=255, db_index=True)
    kind = models.CharField(max_length=8)
    token = models.BigIntegerField()
    owner = models.CharField(max_length=32)
    at_us = models.BigIntegerField(null=True)
    expires_us = models.BigIntegerField(null=True)

    def __str__(self) -> str:
        return f"{self.name} {self.kind} token={self.token}"


class Write(models.Model):
    """An accepted write to a Resource, committed with it.

    ``before_us``/``after_us`` are the database clock at the start and at the end of the
    writing transaction: the fenced write's ownership check happened between them.
    ``op_id`` is not unique on purpose: the checker must be able to see a duplicate.
    """

    name = models.CharField(max_length=255, db_index=True)
    version = models.BigIntegerField()
    op_id = models.CharField(max_length=64, db_index=True)
    worker = models.CharField(max_length=32)
    token = models.BigIntegerField()
    read_value = models.BigIntegerField()
    new_value = models.BigIntegerField()
    before_us = models.BigIntegerField()
    after_us = models.BigIntegerField()

    def __str__(self) -> str:
        return f"{self.name} v{self.version} by {self.op_id} (token {self.token})"
