"""System checks and settings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.core.management import call_command
from django.test import override_settings

from distlock import checks

SQLITE_OK = {
    "ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:",
    "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 5},
}


def ids(messages):
    return sorted(message.id for message in messages)


def test_check_ids_are_unique_across_the_package():
    """Every check id is defined in exactly one place."""
    source = "".join(path.read_text() for path in Path(checks.__file__).parent.rglob("*.py"))
    found = re.findall(r'id="(distlock\.[EW]\d{3})"', source)
    assert found, "no check ids found"
    definitions = {}
    for check_id in found:
        definitions[check_id] = definitions.get(check_id, 0) + 1
    # E005 is one check reported for several settings; the rest appear once.
    assert {k: v for k, v in definitions.items() if v > 1 and k != "distlock.E005"} == {}


def test_default_settings_pass():
    assert checks.check_settings() == []


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("DISTLOCK_DEFAULT_TTL", 0), ("DISTLOCK_DEFAULT_TTL", "60"), ("DISTLOCK_MAX_TTL", -1),
        ("DISTLOCK_POLL_INTERVAL", float("nan")), ("DISTLOCK_RENEW_FRACTION", 1),
        ("DISTLOCK_DEFAULT_TIMEOUT", -2), ("DISTLOCK_DEFAULT_TIMEOUT", True),
        ("DISTLOCK_WAKEUPS", "yes"), ("DISTLOCK_PREPARE_STATEMENTS", 1),
        ("DISTLOCK_DURABLE_RELEASE", "no"),
        # Too large for a float, or for microseconds in a 64-bit integer: an error, not
        # an OverflowError from the check itself.
        ("DISTLOCK_MAX_TTL", 10**400), ("DISTLOCK_MAX_TTL", 1e300),
        ("DISTLOCK_DEFAULT_TIMEOUT", 10**400), ("DISTLOCK_POLL_MAX_INTERVAL", float("inf")),
    ],
)
def test_bad_setting_values(setting, value):
    with override_settings(**{setting: value}):
        assert "distlock.E005" in ids(checks.check_settings())


def test_default_ttl_above_max_ttl():
    with override_settings(DISTLOCK_DEFAULT_TTL=100, DISTLOCK_MAX_TTL=10):
        assert ids(checks.check_settings()) == ["distlock.E005"]


def test_unknown_database_alias():
    with override_settings(DISTLOCK_DATABASE="nope"):
        assert ids(checks.check_settings()) == ["distlock.E001"]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"transaction_mode": "IMMEDIATE", "timeout": 5}, []),
        ({"timeout": 5}, ["distlock.E003"]),
        ({"transaction_mode": "DEFERRED", "timeout": 5}, ["distlock.E003"]),
        ({"transaction_mode": "IMMEDIATE"}, ["distlock.E004"]),
        ({"transaction_mode": "IMMEDIATE", "timeout": 0}, ["distlock.E004"]),
    ],
)
def test_sqlite_transaction_mode_and_busy_timeout(options, expected):
    entry = {**SQLITE_OK, "OPTIONS": options}
    assert ids(checks.database_messages("default", "sqlite", entry)) == expected


def test_atomic_requests_warns():
    entry = {**SQLITE_OK, "ATOMIC_REQUESTS": True}
    assert ids(checks.database_messages("default", "sqlite", entry)) == ["distlock.W001"]


def test_mysql_without_utf8mb4_warns_and_unknown_vendor_errors():
    assert ids(checks.database_messages("default", "mysql", {"OPTIONS": {}})) == ["distlock.W002"]
    assert ids(checks.database_messages("default", "oracle", {})) == ["distlock.E002"]


def test_configured_test_settings_pass_the_checks():
    call_command("check", "--fail-level", "WARNING")
