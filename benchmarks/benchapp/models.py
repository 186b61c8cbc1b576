"""The row the fenced-write benchmark updates (one per worker)."""

from __future__ import annotations

from django.db import models

from distlock.models import FencedModel


class BenchAccount(FencedModel):
    """Guarded by lock ``bench-account:<pk>``, like the README's Account example."""

    fence_name = "bench-account:{pk}"
    balance = models.BigIntegerField(default=0)

    class Meta:
        app_label = "benchapp"
