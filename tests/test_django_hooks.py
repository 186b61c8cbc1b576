"""distlock.fencing.django_hooks overrides Django's private ``Model._do_update``: these
tests fail loudly when Django changes its signature, one test per supported series (the
other series' test skips; CI runs both), and on a Django series nobody has checked."""

from __future__ import annotations

import inspect

import django
import pytest
from django.db.models import Model

from distlock.fencing.django_hooks import DO_UPDATE_PARAMETERS, expected_do_update_parameters


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
