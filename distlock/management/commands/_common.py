"""Helpers shared by the distlock_* management commands (not a command: leading "_")."""

from __future__ import annotations

import re
from datetime import timedelta

from django.conf import settings
from django.core.management.base import CommandError

from distlock.conf import conf

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")


def parse_duration(text: str, what: str) -> timedelta:
    """"90", "90s", "15m", "12h", "7d", "2w" or a sum like "1h30m" -> timedelta.

    Raises CommandError (non-zero exit) for anything else, including negative numbers.
    """
    value = text.strip().lower()
    if not value or _DURATION.sub("", value):
        raise CommandError(
            f"{what}: {text!r} is not a duration; use seconds or a number with s, m, h, d "
            "or w, e.g. 90, 15m, 12h, 7d, 1h30m"
        )
    seconds = sum(float(n) * _UNITS[unit] for n, unit in _DURATION.findall(value))
    return timedelta(seconds=seconds)


def lock_alias(database: str | None) -> str:
    """The lock database alias: --database if given (it must exist), else distlock's."""
    if database is None:
        return conf.database()
    if database not in settings.DATABASES:
        raise CommandError(f"--database {database!r} is not an alias in settings.DATABASES")
    return database
