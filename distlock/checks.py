"""System checks: settings and lock-database configuration that would make locks unsafe."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.conf import conf
from distlock.validation import MAX_SECONDS

SUPPORTED_VENDORS = ("postgresql", "mysql", "sqlite")


def _positive(value: Any) -> bool:
    # Compared, not passed to math.isfinite(), which raises OverflowError for an int too
    # large for a float; NaN fails both comparisons and infinity the upper bound.
    return (
        isinstance(value, int | float) and not isinstance(value, bool)
        and 0 < value <= MAX_SECONDS
    )


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """distlock.E001 (alias) and distlock.E005 (values) for the DISTLOCK_* settings."""
    errors: list[CheckMessage] = []
    alias = conf.DATABASE
    if alias is not None and alias not in settings.DATABASES:
        errors.append(Error(
            f"DISTLOCK_DATABASE = {alias!r} is not an alias in DATABASES.",
            hint="Add that alias to DATABASES or remove DISTLOCK_DATABASE.",
            id="distlock.E001",
        ))
    for name in ("DEFAULT_TTL", "MAX_TTL", "POLL_INTERVAL", "POLL_MAX_INTERVAL"):
        if not _positive(getattr(conf, name)):
            errors.append(Error(
                f"DISTLOCK_{name} must be a positive, finite number of seconds.",
                id="distlock.E005",
            ))
    timeout = conf.DEFAULT_TIMEOUT
    if timeout is not None and not (_positive(timeout) or timeout == 0):
        errors.append(Error(
            "DISTLOCK_DEFAULT_TIMEOUT must be None or a non-negative number of seconds.",
            id="distlock.E005",
        ))
    fraction = conf.RENEW_FRACTION
    if not (_positive(fraction) and fraction < 1):
        errors.append(Error(
            "DISTLOCK_RENEW_FRACTION must be a number between 0 and 1 (exclusive).",
            id="distlock.E005",
        ))
    for key in ("WAKEUPS", "PREPARE_STATEMENTS", "DURABLE_RELEASE"):
        if not isinstance(getattr(conf, key), bool):
            errors.append(Error(f"DISTLOCK_{key} must be True or False.", id="distlock.E005"))
    if (
        _positive(conf.DEFAULT_TTL) and _positive(conf.MAX_TTL)
        and conf.DEFAULT_TTL > conf.MAX_TTL
    ):
        errors.append(Error(
            "DISTLOCK_DEFAULT_TTL is larger than DISTLOCK_MAX_TTL.", id="distlock.E005",
        ))
    return errors


def exact_collation(collation: str) -> bool:
    """Does this MariaDB/MySQL collation compare strings byte for byte?

    Only a binary collation that is also NO PAD does: ``utf8mb4_bin`` is binary but PAD
    SPACE, so ``'lock'`` and ``'lock '`` are equal in it. MariaDB spells NO PAD
    ``_nopad_``; MySQL 8's ``utf8mb4_0900_bin`` is NO PAD, as all its ``_0900_`` ones are.
    """
    return collation == "binary" or (
        collation.endswith("_bin") and ("_nopad_" in collation or "_0900_" in collation)
    )


def name_collation(connection: BaseDatabaseWrapper) -> str | None:
    """The collation the lock table's ``name`` column really has (None: no table yet)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT COLLATION_NAME FROM information_schema.COLUMNS WHERE "
            "TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'distlock_lock' "
            "AND COLUMN_NAME = 'name'"
        )
        row = cursor.fetchone()
    return None if row is None else str(row[0])


def check_database(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Backend checks on the lock table's database (E002–E004, W001, W002).

    The settings are checked always; the live table (W002's collation) only when the
    check run names this database (``manage.py check --database``, ``migrate``), as
    Django does for its own checks that need a connection.
    """
    alias = conf.DATABASE or "default"
    if alias not in settings.DATABASES:
        return []  # reported by E001
    connection = connections[alias]
    collation = None
    if connection.vendor == "mysql" and alias in (databases or ()):
        collation = name_collation(connection)
    return database_messages(
        alias, connection.vendor, connection.settings_dict, name_collation=collation
    )


def database_messages(
    alias: str, vendor: str, settings_dict: dict[str, Any], *,
    name_collation: str | None = None,
) -> list[CheckMessage]:
    """The backend checks for one DATABASES entry (separate from connections, for tests).

    ``name_collation`` is the collation of the lock table's name column on MariaDB/MySQL,
    if it was looked up.
    """
    options = settings_dict.get("OPTIONS", {})
    messages: list[CheckMessage] = []
    if vendor not in SUPPORTED_VENDORS:
        messages.append(Error(
            f"distlock does not support the {vendor!r} backend (database {alias!r}).",
            hint="Use PostgreSQL, MariaDB/MySQL or SQLite for the lock table.",
            id="distlock.E002",
        ))
    if vendor == "sqlite":
        if str(options.get("transaction_mode", "")).upper() != "IMMEDIATE":
            messages.append(Error(
                f"SQLite database {alias!r} does not use IMMEDIATE transactions.",
                hint=(
                    'Set DATABASES[...]["OPTIONS"]["transaction_mode"] = "IMMEDIATE". '
                    "A DEFERRED transaction that reads and then writes fails at once with "
                    "'database is locked' instead of waiting for the lock holder."
                ),
                id="distlock.E003",
            ))
        timeout = options.get("timeout")
        if not _positive(timeout):
            messages.append(Error(
                f"SQLite database {alias!r} has no busy timeout.",
                hint='Set DATABASES[...]["OPTIONS"]["timeout"] to seconds to wait, e.g. 20.',
                id="distlock.E004",
            ))
    if settings_dict.get("ATOMIC_REQUESTS"):
        messages.append(Warning(
            f"Database {alias!r} holds the lock table and has ATOMIC_REQUESTS = True, so "
            "every view runs inside a transaction there and distlock will refuse to lock.",
            hint=(
                "Give distlock its own connection: DATABASES['distlock'] = "
                f"{{**DATABASES[{alias!r}], 'ATOMIC_REQUESTS': False}} and "
                "DISTLOCK_DATABASE = 'distlock'."
            ),
            id="distlock.W001",
        ))
    if vendor == "mysql":
        messages.extend(_inexact_names(alias, options, name_collation))
    return messages


def _inexact_names(
    alias: str, options: dict[str, Any], collation: str | None
) -> list[CheckMessage]:
    """distlock.W002: on MariaDB/MySQL, would two different lock names be one lock?

    Two ways: a name column whose collation folds case, accents or trailing spaces (the
    migration gives it a binary NO PAD one; a hand-made or converted table may not have
    it), or a connection charset other than utf8mb4, in which characters outside the
    Basic Multilingual Plane cannot be sent (they fail, or become "?" outside strict
    mode). Django (5.2+) connects with utf8mb4 unless OPTIONS say otherwise, so a
    missing "charset" is fine.
    """
    problems = []
    charset = options.get("charset", "utf8mb4")
    if charset != "utf8mb4":
        problems.append(
            f"the connection charset is {charset!r}, in which characters such as emoji "
            "cannot be sent (names with them fail, or collide as '?')"
        )
    if collation is not None and not exact_collation(collation):
        problems.append(
            f"distlock_lock.name has the collation {collation}, which folds case, accents "
            "or trailing spaces ('lock', 'LOCK' and 'lóck' would be one lock)"
        )
    if not problems:
        return []
    return [Warning(
        f"MySQL/MariaDB database {alias!r} would not keep lock names apart exactly: "
        + "; ".join(problems) + ".",
        hint='Leave OPTIONS["charset"] unset (Django uses utf8mb4) or set it to "utf8mb4"; '
        "give distlock_lock.name a binary NO PAD collation (utf8mb4_nopad_bin on MariaDB, "
        "utf8mb4_0900_bin on MySQL), as distlock's migration creates it.",
        id="distlock.W002",
    )]


def check_fenced_models(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """distlock.E010–E012, W010: every concrete FencedModel says which lock guards its rows,
    and its managers refuse to write the token.

    Caught at start-up rather than at the first fenced write, which may run in a rare
    code path (a nightly job) long after the deploy.
    """
    from django.apps import apps

    from distlock.fencing import (
        FencedModel,
        is_fenced_manager,
        nullable_template_fields,
        template_problems,
    )

    configs = app_configs if app_configs is not None else apps.get_app_configs()
    messages: list[CheckMessage] = []
    for config in configs:
        for model in config.get_models():
            if not issubclass(model, FencedModel):
                continue
            plain = [
                manager.name for manager in (*model._meta.managers, model._base_manager)
                if not is_fenced_manager(manager)
            ]
            for name in dict.fromkeys(plain):
                messages.append(Warning(
                    f"{model._meta.label}.{name} is not built on FencedQuerySet: its "
                    "update(), bulk_update() and bulk_create(update_conflicts=True) can "
                    "lower fence_token.",
                    hint="Build it with FencedManager or FencedQuerySet (e.g. "
                    "FencedManager.from_queryset(MyQuerySet)); on PostgreSQL the "
                    "RefuseLowerFenceToken migration operation stops every writer.",
                    obj=model, id="distlock.W010",
                ))
            overridden = model.get_fence_name is not FencedModel.get_fence_name
            if model.fence_name is None:
                if not overridden:
                    messages.append(Error(
                        f"{model._meta.label} is a FencedModel but does not say which lock "
                        "guards its rows.",
                        hint='Set fence_name = "name:{pk}" (a template over field names) '
                        "or override get_fence_name().",
                        obj=model, id="distlock.E010",
                    ))
                continue
            for problem in template_problems(model):
                messages.append(Error(
                    f"{model._meta.label}.fence_name is not usable: {problem}.",
                    hint="Use plain {field} names of integer or text columns (pk works), "
                    "or override get_fence_name() and get_fence_name_expression().",
                    obj=model, id="distlock.E011",
                ))
            for name in nullable_template_fields(model):
                messages.append(Error(
                    f"{model._meta.label}.fence_name uses field {name!r}, which allows NULL.",
                    hint="A NULL has no lock name that Python and SQL agree on (str.format "
                    "writes 'None', SQL concatenation ''). Make the field null=False, or "
                    "override get_fence_name() and get_fence_name_expression().",
                    obj=model, id="distlock.E012",
                ))
    return messages
