"""distlock.fencing.django_hooks overrides Django's private ``Model._do_update``: these
tests fail loudly when Django changes its signature, one test per supported series (the
other series' test skips; CI runs both), and on a Django series nobody has checked."""

from __future__ import annotations

import inspect

import django
import pytest
from django.db.models import Model
from django.db.models.signals import post_save

from distlock import StaleToken, acquire
from distlock.fencing import django_hooks
from distlock.fencing.django_hooks import DO_UPDATE_PARAMETERS, expected_do_update_parameters
from distlock.testing import make_stale
from tests.factories import AccountFactory
from tests.testapp.models import Account


def _installed() -> tuple[str, ...]:
    return tuple(inspect.signature(Model._do_update).parameters)


def test_the_installed_django_is_a_series_the_override_was_checked_against():
    assert expected_do_update_parameters() is not None, (
        f"Django {django.get_version()}: check distlock.fencing.django_hooks' _do_update "
        f"override against Model._do_update{inspect.signature(Model._do_update)} and add "
        "the series to DO_UPDATE_PARAMETERS"
    )


@pytest.mark.skipif(django.VERSION[:2] != (5, 2), reason="Django 5.2 only (CI runs it)")
def test_do_update_signature_on_django_5_2():
    assert _installed() == DO_UPDATE_PARAMETERS[(5, 2)]


@pytest.mark.skipif(django.VERSION[0] != 6, reason="Django 6.x only (CI runs it)")
def test_do_update_signature_on_django_6():
    assert _installed() == DO_UPDATE_PARAMETERS[(6,)]


def test_the_lookup_picks_a_series_by_minor_then_major_version():
    assert expected_do_update_parameters((5, 2, 7, "final", 0)) == DO_UPDATE_PARAMETERS[(5, 2)]
    assert expected_do_update_parameters((6, 1, 0, "final", 0)) == DO_UPDATE_PARAMETERS[(6,)]
    assert expected_do_update_parameters((5, 1, 0, "final", 0)) is None
    assert expected_do_update_parameters((7, 0, 0, "alpha", 0)) is None


@pytest.mark.usefixtures("lock_db")
def test_a_fenced_save_fences_its_own_update_only_and_leaves_nothing_behind():
    """save(fence=) hands its state to the hook for that save call only: nothing lands on
    the instance, another row saved meanwhile (a signal receiver) gets a plain save, and
    the state is gone afterwards, also after a refusal."""
    account, other = AccountFactory(), AccountFactory()
    lease = acquire(f"account:{account.pk}", ttl=30)
    keys = set(vars(account))

    def receiver(sender, instance, **kwargs):
        if instance is account:
            other.note = "plain"
            other.save()

    post_save.connect(receiver, sender=Account)
    try:
        account.save(fence=lease)
    finally:
        post_save.disconnect(receiver, sender=Account)
    assert set(vars(account)) == keys
    assert list(Account.objects.values_list("pk", "note", "fence_token").order_by("pk")) == [
        (account.pk, account.note, lease.token), (other.pk, "plain", 0)
    ]
    assert django_hooks._current.get() is None
    make_stale(lease)
    with pytest.raises(StaleToken):
        account.save(fence=lease)
    assert django_hooks._current.get() is None
