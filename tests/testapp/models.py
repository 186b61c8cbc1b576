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


# -- tests/test_collations.py: lock names over text columns whose collation the test sets --
# Declared with the database's default collation; the collation matrix gives each column
# the collation under test (schema_editor.alter_field) and gives the default back after.


class CollatedChar(FencedModel):
    """A lock named after a unique CharField (the issue's ``Counter``)."""

    fence_name = "char:{key}"

    key = models.CharField(max_length=50, unique=True)
    value = models.IntegerField(default=0)


class CollatedSlug(FencedModel):
    """A lock named after a unique SlugField."""

    fence_name = "slug:{key}"

    key = models.SlugField(max_length=50, unique=True, allow_unicode=True)
    value = models.IntegerField(default=0)


class CollatedText(FencedModel):
    """A lock named after a TextField: not unique (MariaDB indexes no TEXT column without a
    prefix length), so only the pk pins one row."""

    fence_name = "text:{key}"

    key = models.TextField()
    value = models.IntegerField(default=0)


class CollatedResource(FencedModel):
    """A text primary key that is the lock's name (the issue's ``Resource``)."""

    fence_name = "resource:{name}"

    name = models.CharField(max_length=50, primary_key=True)
    value = models.IntegerField(default=0)


class CollatedPair(FencedModel):
    """A lock name over two text columns: the name test is an expression (a Concat), not
    one column."""

    fence_name = "pair:{left}/{right}"

    left = models.CharField(max_length=50)
    right = models.CharField(max_length=50)
    value = models.IntegerField(default=0)


class Customer(models.Model):
    """A plain model that fenced rows point at: a filter through it is a join."""

    name = models.CharField(max_length=50)


class Shipment(FencedModel):
    """Rows of a customer behind a foreign key, guarded by that customer's lock."""

    fence_name = "customer:{customer_id}"

    customer = models.ForeignKey(Customer, on_delete=models.CASCADE)
    status = models.CharField(max_length=20, default="new")
