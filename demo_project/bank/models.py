"""An account balance guarded by a lock, and what each demo task did to it."""

from __future__ import annotations

from django.db import models

from distlock.models import FencedModel


class Account(FencedModel):
    """A balance that deposits update with read-modify-write, under lock ``account:<pk>``.

    Fenced deposits write through ``fenced_update(lease, ...)``: the database refuses a
    holder whose lease has run out, even though it still believes it holds the lock.
    """

    fence_name = "account:{pk}"

    name = models.CharField(max_length=100)
    balance = models.IntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.name}: {self.balance}"


class Attempt(models.Model):
    """One run of a deposit task: recorded when it got the lock, completed at its end.

    contention_demo prints these as they happen and builds its report from them. A
    paused holder also watches this table to know when the next holder has read.
    """

    class Outcome(models.TextChoices):
        RUNNING = "running"
        WRITTEN = "written"
        REFUSED = "refused", "stale write refused"
        FAILED = "failed"

    run = models.CharField(max_length=32, db_index=True)
    mode = models.CharField(max_length=10)  # "fenced" or "unfenced"
    account = models.ForeignKey(Account, on_delete=models.CASCADE)
    task_no = models.IntegerField()
    retry = models.IntegerField(default=0)
    token = models.BigIntegerField()
    worker = models.CharField(max_length=200, blank=True)
    pid = models.IntegerField()
    waited = models.FloatField(help_text="Seconds between the task starting and its grant.")
    read_balance = models.IntegerField()
    paused = models.FloatField(default=0, help_text="Seconds it stalled past its lease.")
    taken_over_by = models.BigIntegerField(
        null=True, help_text="Token of the holder that took the lock during the pause."
    )
    wrote_balance = models.IntegerField(null=True)
    outcome = models.CharField(max_length=10, choices=Outcome.choices, default="running")
    detail = models.CharField(max_length=500, blank=True)
    lease_still_held = models.BooleanField(null=True)
    wrote_us = models.BigIntegerField(
        null=True, help_text="When its write was done or refused (database clock, epoch µs): "
        "the report's timeline places accepted stale writes, which no lock event records.",
    )

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.mode} task {self.task_no} token {self.token}: {self.outcome}"
