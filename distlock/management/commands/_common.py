"""Helpers shared by the distlock_* management commands (not a command: leading "_")."""

from __future__ import annotations

import getpass
import math
import re
import socket
import sys
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from distlock.conf import conf
from distlock.constants import MAX_SECONDS
from distlock.times import from_us

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_INTEGER = re.compile(r"-?[0-9]+")


def _text(value: object) -> str:
    """An option's value as text: call_command() may pass a number (or anything else)
    where the command line gives a str, and it gets the same checks and messages."""
    return value if isinstance(value, str) else str(value)


def quoted(text: str) -> str:
    """``text`` quoted for a message, cut short if it is long (a value of 5,000 digits
    is not repeated in full)."""
    if len(text) <= 40:
        return repr(text)
    return f"{text[:40]!r}… ({len(text):,} characters)"


def parse_duration(text: object, what: str) -> timedelta:
    """"90", "90s", "15m", "12h", "7d", "2w" or a sum like "1h30m" -> timedelta.

    Raises CommandError (non-zero exit) for anything else, including negative numbers.
    """
    text = _text(text)
    value = text.strip().lower()
    if not value or _DURATION.sub("", value):
        raise CommandError(
            f"{what}: {quoted(text)} is not a duration; use seconds or a number with s, m, h, "
            "d or w, e.g. 90, 15m, 12h, 7d, 1h30m"
        )
    seconds = sum(float(n) * _UNITS[unit] for n, unit in _DURATION.findall(value))
    # Checked here, before timedelta() could raise OverflowError (a traceback, not a
    # message) and before any command deletes anything with the first of its durations.
    if not seconds <= MAX_SECONDS:
        raise CommandError(
            f"{what}: {quoted(text)} is too long; durations are limited to {MAX_SECONDS:,} s "
            "(about 31,700 years)"
        )
    return timedelta(seconds=seconds)


def parse_int(text: object, what: str) -> int:
    """A whole number in ASCII digits, e.g. a token; CommandError for anything else.

    Parsed here rather than by argparse (``type=int``), whose error exits with status 2
    and a usage line instead of the CommandError every other bad value gets. Not bounded
    here: each caller checks its own range before a database sees the number.
    """
    text = _text(text)
    value = text.strip()
    if not _INTEGER.fullmatch(value):
        raise CommandError(f"{what}: {quoted(text)} is not a whole number")
    try:
        return int(value)
    except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits())
        raise CommandError(f"{what}: {quoted(text)} has too many digits") from None


def parse_seconds(text: object, what: str) -> float:
    """A number of seconds such as "1", "0.25" or "1e-3", between 0 and MAX_SECONDS.

    CommandError for anything else, including NaN, infinity and numbers too large for a
    float ("1e400" parses as infinity).
    """
    text = _text(text)
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_SECONDS:
        raise CommandError(
            f"{what}: {quoted(text)} is not a number of seconds between 0 and {MAX_SECONDS:,}"
        )
    return seconds


def local_time(at_us: int) -> str:
    """A database time for people, in the site's time zone (``TIME_ZONE``) with the zone
    written beside it: "2026-12-03 17:37:49 IST (UTC+05:30)", "2026-12-03 12:07:49 UTC".

    The zone is always said: a bare time on an IST site was read as the app server's, or
    as UTC. Zones without an abbreviation (tzdata writes "+04") get the offset only.
    """
    moment = timezone.localtime(from_us(at_us))
    zone = moment.strftime("%Z")
    sign_hours_minutes = moment.strftime("%z")  # "+0530"
    offset = f"UTC{sign_hours_minutes[:3]}:{sign_hours_minutes[3:5]}"
    stamp = f"{moment:%Y-%m-%d %H:%M:%S}"
    if zone == "UTC" and offset == "UTC+00:00":
        return f"{stamp} UTC"
    if not zone or zone[0] in "+-":
        return f"{stamp} {offset}"
    return f"{stamp} {zone} ({offset})"


def capped(count: int, cap: int) -> str:
    """A count made with a cap (``queryset[:cap].count()``), in words: "12", or
    "10,000 or more" when it reached the cap."""
    return f"{cap:,} or more" if count >= cap else f"{count:,}"


def lock_alias(database: str | None) -> str:
    """The lock database alias: --database if given (it must exist), else distlock's."""
    if database is None:
        return conf.database()
    if database not in settings.DATABASES:
        raise CommandError(f"--database {database!r} is not an alias in settings.DATABASES")
    return database


class LockCommand(BaseCommand):
    """A distlock command: ``--database`` picks the lock database (default: distlock's).

    The alias is checked before anything else the command does, so a misspelt alias
    changes nothing; ``run()`` gets it checked, and the command's other options. The
    help text is the first paragraph of the command module's docstring: one place for it.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        doc = sys.modules[cls.__module__].__doc__ or ""
        cls.help = " ".join(doc.partition("\n\n")[0].split())

    def add_arguments(self, parser: CommandParser) -> None:
        self.add_options(parser)
        parser.add_argument("--database", help="Lock database alias (default: distlock's).")

    def add_options(self, parser: CommandParser) -> None:
        """Add the command's own arguments."""

    def handle(self, *args: Any, **options: Any) -> None:
        self.run(lock_alias(options["database"]), **options)

    def run(self, alias: str, **options: Any) -> None:
        raise NotImplementedError


def who(command: str) -> str:
    """Who ran ``command``, for the audit's "by" (user at host)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER, e.g. in some containers
        user = "?"
    return f"manage.py {command} ({user}@{socket.gethostname()})"
