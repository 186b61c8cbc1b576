"""Models used only by the tests."""

from __future__ import annotations

from django.db import models

from distlock.models import FencedModel


class Account(FencedModel):
    """One lock per row, named after the primary key."""

    fence_name = "account:{pk}"

    balance = models.IntegerField(default=0)
    note = models.CharField(max_length=100, blank=True, default="")

    def __str__(self) -> str:
        return f"account {self.pk}"


class HighWaterAccount(FencedModel):
    """The same, with only the high-water mark (no ownership check): shows its gap."""

    fence_name = "account:{pk}"
    fence_check_ownership = False

    balance = models.IntegerField(default=0)
    note = models.CharField(max_length=100, blank=True, default="")


class Order(FencedModel):
    """Many rows per lock: every order of a customer is guarded by that customer's lock."""

    fence_name = "customer:{customer_id}"

    customer_id = models.IntegerField()
    status = models.CharField(max_length=20, default="new")
    amount = models.IntegerField(default=0)


class Counter(FencedModel):
    """A counter guarded by a lock named after a text column."""

    fence_name = "counter:{key}"

    key = models.CharField(max_length=50, unique=True)
    value = models.IntegerField(default=0)


class Ledger(FencedModel):
    """One lock for the whole table (a template without fields)."""

    fence_name = "ledger"

    entry = models.CharField(max_length=100)


class Document(FencedModel):
    """Lock name from a method, with its SQL form for bulk writes."""

    folder = models.CharField(max_length=50)
    title = models.CharField(max_length=100, default="")

    def get_fence_name(self) -> str:
        return f"folder/{self.folder.lower()}"

    @classmethod
    def get_fence_name_expression(cls):
        from django.db.models import F, Value
        from django.db.models.functions import Concat, Lower

        return Concat(Value("folder/"), Lower(F("folder")))


class Sheet(FencedModel):
    """A lock name over two text columns: every sheet of a tab shares the tab's lock.

    Names built from two fields can collide across rows ("sheet:a:b:c" is book "a", tab
    "b:c" and book "a:b", tab "c"); both rows are then guarded by that one lock.
    """

    fence_name = "sheet:{book}:{tab}"

    book = models.CharField(max_length=50)
    tab = models.CharField(max_length=50)
    body = models.CharField(max_length=100, blank=True, default="")


class Slot(FencedModel):
    """A lock name over an integer and a text column."""

    fence_name = "slot:{day}/{label}"

    day = models.IntegerField()
    label = models.CharField(max_length=50)
    booked = models.IntegerField(default=0)
