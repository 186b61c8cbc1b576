"""System checks of the metrics' own settings (E030, E031), registered by this app."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error

from distlock.contrib.prometheus.labels import setting_problem


def check_metrics_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """distlock.E030/E031: DISTLOCK_METRICS_NAME_PATTERN names a function that turns a
    lock name into a str (registered by this app's ready(), which uses it).

    Checked at start-up because at run time the metrics must not fail a lock operation:
    there a broken function only logs and counts under ``<invalid>``.
    """
    problem = setting_problem()
    if problem is None:
        return []
    where, message = problem
    message = f"DISTLOCK_METRICS_NAME_PATTERN is unusable: {message}."
    hint = (
        "Give the dotted path of a function that takes a lock name (str) and returns its "
        "label (str), e.g. the default 'distlock.contrib.prometheus.labels.name_pattern'."
    )
    if where == "path":
        return [Error(message, hint=hint, id="distlock.E030")]
    return [Error(message, hint=hint, id="distlock.E031")]
