"""factory-boy factories for the test models (plain, unfenced creation)."""

from __future__ import annotations

import factory

from tests.testapp.models import Account, Counter, Order, Sheet, Slot


class AccountFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Account

    balance = 0
    note = ""


class OrderFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Order

    customer_id = factory.Sequence(lambda n: n + 1)
    status = "new"
    amount = factory.Faker("pyint", min_value=1, max_value=100)


class CounterFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Counter

    key = factory.Sequence(lambda n: f"counter-{n}")
    value = 0


class SheetFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Sheet

    book = "book"
    tab = factory.Sequence(lambda n: f"tab-{n}")
    body = ""


class SlotFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Slot

    day = factory.Sequence(lambda n: n + 1)
    label = "am"
    booked = 0
