"""The protected resource of every lab trial: counter rows in PostgreSQL.

One lock (``lab-resource``) guards the whole table, so a trial can have the new holder
write one row and the stale holder another (the ``untouched`` scenario). ``fence_token``
is distlock's high-water mark; the etcd contender writes its revision there too.
"""

from __future__ import annotations

from django.db import models

from distlock.models import FencedModel

LOCK_NAME = "lab-resource"


class Cell(FencedModel):
    """A counter row; written only as "read, then write the read value plus one"."""

    fence_name = LOCK_NAME

    key = models.CharField(max_length=20, primary_key=True)
    value = models.IntegerField(default=0)

    class Meta:
        app_label = "lab"
        db_table = "lab_cell"
