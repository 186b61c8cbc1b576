"""System checks and settings."""

from __future__ import annotations

import re
from pathlib import Path

import django
import pytest
from django.core.checks import Tags, run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connections
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
        ("DISTLOCK_LISTENING_WAITERS", 0), ("DISTLOCK_LISTENING_WAITERS", 2.0),
        ("DISTLOCK_LISTENING_WAITERS", True), ("DISTLOCK_LISTENING_WAITERS", 2**31),
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


def test_atomic_requests_hint_advises_a_second_alias_only_where_it_helps():
    lite = {**SQLITE_OK, "ATOMIC_REQUESTS": True}
    (on_sqlite,) = checks.database_messages("default", "sqlite", lite)
    assert "would not help" in on_sqlite.hint and "DISTLOCK_DATABASE" not in on_sqlite.hint
    assert "non_atomic_requests" in on_sqlite.hint
    pg = {"ENGINE": "django.db.backends.postgresql", "NAME": "app", "ATOMIC_REQUESTS": True}
    (on_pg,) = checks.database_messages("default", "postgresql", pg)
    assert "DISTLOCK_DATABASE = 'distlock'" in on_pg.hint


def test_unknown_vendor_errors():
    assert ids(checks.database_messages("default", "oracle", {})) == ["distlock.E002"]


@pytest.mark.parametrize(
    ("options", "collation", "expected"),
    [
        # Django 5.2+ connects with utf8mb4 when OPTIONS name no charset: no warning (W002
        # used to warn here, on every default MariaDB/MySQL set-up).
        ({}, None, []),
        ({"charset": "utf8mb4"}, "utf8mb4_nopad_bin", []),
        ({}, "utf8mb4_0900_bin", []),
        # Characters outside the BMP cannot be sent in utf8mb3.
        ({"charset": "utf8"}, None, ["distlock.W002"]),
        ({"charset": "utf8mb3"}, "utf8mb4_nopad_bin", ["distlock.W002"]),
        # Folding collations, and a binary one that pads ('lock' = 'lock ').
        ({}, "utf8mb4_general_ci", ["distlock.W002"]),
        ({}, "utf8mb4_unicode_ci", ["distlock.W002"]),
        ({}, "utf8mb4_bin", ["distlock.W002"]),
    ],
)
def test_mysql_names_that_would_not_compare_exactly_warn(options, collation, expected):
    messages = checks.database_messages(
        "default", "mysql", {"OPTIONS": options}, name_collation=collation
    )
    assert ids(messages) == expected
    if expected:
        assert "would not keep lock names apart exactly" in messages[0].msg
        assert (collation or "") in messages[0].msg or "charset" in messages[0].msg


def test_w002_reads_the_real_lock_table_on_mariadb(folding_name_column):
    """On the live table: silent with the migration's collation, W002 naming a folding
    one, and the table is looked at only when the check run names the database."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        assert checks.check_database() == []  # no --database: no query
    assert len(queries) == 0
    messages = checks.check_database(databases=["default"])
    assert ids(messages) == ["distlock.W002"]
    assert f"distlock_lock.name has the collation {folding_name_column}" in messages[0].msg
    assert "charset" not in messages[0].msg.split(":", 1)[1]


@pytest.mark.usefixtures("lock_db")
def test_the_test_database_passes_the_database_checks():
    """`check --database` runs W002 against the real table (on MariaDB: utf8mb4 and
    utf8mb4_nopad_bin, the settings and the migration this suite uses)."""
    call_command("check", "--database", "default", "--fail-level", "WARNING")
    assert checks.check_database(databases=["default"]) == []


def test_configured_test_settings_pass_the_checks():
    call_command("check", "--fail-level", "WARNING")


# --- the database checks through Django's check framework -----------------------------
#
# What each backend can trigger for real: W001 (ATOMIC_REQUESTS) everywhere; E003 and E004
# (transaction mode, busy timeout) on SQLite; W002 (charset, or the live table's
# collation) on MariaDB/MySQL. PostgreSQL has no checks of its own, so only W001 there.
# E002 (an unsupported vendor) needs a DATABASES entry whose backend Django can load but
# distlock does not support; none is installed here (Oracle needs its driver), so it is
# covered through database_messages() above only.

TRIGGERS = {
    "distlock.W001": (None, {"ATOMIC_REQUESTS": True}),
    "distlock.E003": ("sqlite", {"OPTIONS": {"timeout": 5}}),
    "distlock.E004": ("sqlite", {"OPTIONS": {"transaction_mode": "IMMEDIATE"}}),
    "distlock.W002": ("mysql", {"OPTIONS": {"charset": "utf8mb3"}}),
}


def registered_database_checks(**kwargs) -> list[str]:
    """The distlock ids that Django's own check run reports (registered checks only)."""
    return [found for found in ids(run_checks(**kwargs)) if found.startswith("distlock.")]


@pytest.mark.django_db(transaction=True, databases=["default", "locks"])
@pytest.mark.parametrize("check_id", sorted(TRIGGERS))
def test_the_registered_database_check_runs_in_djangos_check_framework(check_id, monkeypatch):
    """The lock alias (DISTLOCK_DATABASE) set up wrong: Django's check run reports it.

    Run as ``manage.py check --database locks`` runs them (databases named): the live
    table is looked at too, which on MariaDB finds the collation right.
    """
    vendor, changes = TRIGGERS[check_id]
    this_run = connections["locks"].vendor
    if vendor is not None and vendor != this_run:
        pytest.skip(f"{check_id} is a {vendor} check (this run: {this_run})")
    with override_settings(DISTLOCK_DATABASE="locks"):
        assert registered_database_checks(databases=["locks"]) == []
        for key, value in changes.items():
            monkeypatch.setitem(connections["locks"].settings_dict, key, value)
        assert registered_database_checks(databases=["locks"]) == [check_id]
        assert registered_database_checks(tags=[Tags.database], databases=[]) == [check_id]
        if django.VERSION < (6, 1):
            # A plain `manage.py check` runs database-tagged checks too before Django 6.1
            # (which runs them only when databases are named): these findings need the
            # settings only, not a connection.
            assert registered_database_checks(databases=[]) == [check_id]


@pytest.mark.django_db(transaction=True, databases=["default", "locks"])
def test_check_with_the_lock_database_reports_its_warning(monkeypatch):
    """`manage.py check --database` on the lock alias fails on distlock.W001."""
    with override_settings(DISTLOCK_DATABASE="locks"):
        monkeypatch.setitem(connections["locks"].settings_dict, "ATOMIC_REQUESTS", True)
        with pytest.raises(SystemCheckError, match=r"distlock\.W001"):
            call_command("check", "--database", "locks", "--fail-level", "WARNING")


def test_w002_of_the_live_table_through_the_check_framework(folding_name_column):
    # The live table is looked at only when the run names its database.
    assert "distlock.W002" not in registered_database_checks(tags=[Tags.database], databases=[])
    assert registered_database_checks(databases=["default"]) == ["distlock.W002"]
