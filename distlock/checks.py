"""System checks: settings and lock-database configuration that would make locks unsafe."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.db import connections

from distlock.backends import backend_named, supported
from distlock.conf import conf
from distlock.validation import positive_seconds


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
        if not positive_seconds(getattr(conf, name)):
            errors.append(Error(
                f"DISTLOCK_{name} must be a positive, finite number of seconds.",
                id="distlock.E005",
            ))
    timeout = conf.DEFAULT_TIMEOUT
    if timeout is not None and not (positive_seconds(timeout) or timeout == 0):
        errors.append(Error(
            "DISTLOCK_DEFAULT_TIMEOUT must be None or a non-negative number of seconds.",
            id="distlock.E005",
        ))
    fraction = conf.RENEW_FRACTION
    if not (positive_seconds(fraction) and fraction < 1):
        errors.append(Error(
            "DISTLOCK_RENEW_FRACTION must be a number between 0 and 1 (exclusive).",
            id="distlock.E005",
        ))
    for key in ("WAKEUPS", "PREPARE_STATEMENTS", "DURABLE_RELEASE"):
        if not isinstance(getattr(conf, key), bool):
            errors.append(Error(f"DISTLOCK_{key} must be True or False.", id="distlock.E005"))
    listeners = conf.LISTENING_WAITERS
    # An int4 for distlock_enqueue's p_listeners; bool is an int, but not a count.
    if type(listeners) is not int or not 1 <= listeners <= 2**31 - 1:
        errors.append(Error(
            "DISTLOCK_LISTENING_WAITERS must be a whole number of at least 1.",
            id="distlock.E005",
        ))
    errors.extend(_policy_errors())
    if (
        positive_seconds(conf.DEFAULT_TTL) and positive_seconds(conf.MAX_TTL)
        and conf.DEFAULT_TTL > conf.MAX_TTL
    ):
        errors.append(Error(
            "DISTLOCK_DEFAULT_TTL is larger than DISTLOCK_MAX_TTL.", id="distlock.E005",
        ))
    return errors


def _policy_errors() -> list[CheckMessage]:
    """DISTLOCK_MIN_HOLD, _MAX_HOLD and _LOCK_DELAY (docs/lease-policies.md): each None or a
    positive duration, and the default ttl within the holds (else every call that leaves
    its ttl and holds to the settings would raise)."""
    errors: list[CheckMessage] = []
    values: dict[str, float] = {}
    for name in ("MIN_HOLD", "MAX_HOLD", "LOCK_DELAY"):
        value = getattr(conf, name)
        if isinstance(value, timedelta):
            value = value.total_seconds()
        if value is None:
            continue
        if positive_seconds(value):
            values[name] = float(value)
        else:
            errors.append(Error(
                f"DISTLOCK_{name} must be None or a positive number of seconds (or a "
                "timedelta).", id="distlock.E005",
            ))
    ttl = conf.DEFAULT_TTL
    if positive_seconds(ttl):
        if values.get("MIN_HOLD", 0) > ttl:
            errors.append(Error(
                "DISTLOCK_MIN_HOLD is longer than DISTLOCK_DEFAULT_TTL.", id="distlock.E005",
            ))
        if values.get("MAX_HOLD", ttl) < ttl:
            errors.append(Error(
                "DISTLOCK_MAX_HOLD is shorter than DISTLOCK_DEFAULT_TTL.", id="distlock.E005",
            ))
    return errors


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
    backend = supported(connection)
    collation = None
    if backend is not None and alias in (databases or ()):
        collation = backend.name_collation(connection)
    return database_messages(
        alias, connection.vendor, connection.settings_dict, name_collation=collation
    )


def database_messages(
    alias: str, vendor: str, settings_dict: dict[str, Any], *,
    name_collation: str | None = None,
) -> list[CheckMessage]:
    """The backend checks for one DATABASES entry (separate from connections, for tests).

    ``name_collation`` is the collation of the lock table's name column where the backend
    looked it up (MariaDB/MySQL). The vendor's own checks are its backend's.
    """
    messages: list[CheckMessage] = []
    backend = backend_named(vendor)
    if backend is None:
        messages.append(Error(
            f"distlock does not support the {vendor!r} backend (database {alias!r}).",
            hint="Use PostgreSQL, MariaDB/MySQL or SQLite for the lock table.",
            id="distlock.E002",
        ))
    else:
        messages.extend(
            backend.check_messages(alias, settings_dict, name_collation=name_collation)
        )
    if settings_dict.get("ATOMIC_REQUESTS"):
        advice = (
            backend.own_connection_advice(alias) if backend is not None
            else "Give distlock a database alias of its own."
        )
        messages.append(Warning(
            f"Database {alias!r} holds the lock table and has ATOMIC_REQUESTS = True, so "
            "every view runs inside a transaction there and distlock will refuse to lock.",
            hint=advice + " Or mark the views that lock with "
            "@transaction.non_atomic_requests.",
            id="distlock.W001",
        ))
    return messages


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
        for candidate in config.get_models():
            if not issubclass(candidate, FencedModel):
                continue
            # Checked just above; get_models() is typed as returning Any | type[Model].
            model = cast("type[FencedModel]", candidate)
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
