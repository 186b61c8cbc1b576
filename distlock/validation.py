"""Argument checks shared by every public entry point.

They run before any SQL, so bad input raises a clear error and changes nothing.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from decimal import Decimal

from django.conf import settings

from distlock.conf import conf
from distlock.constants import MAX_NAME_LENGTH, MAX_SECONDS, MAX_TOKEN, MIN_TTL, OWNER_LENGTH

Seconds = float | int | Decimal | timedelta


def _check_characters(text: str, what: str) -> str:
    """Refuse the characters that no backend stores as given.

    PostgreSQL's text columns refuse NUL (a DataError, raised after the statement was
    sent), while SQLite and MariaDB store it, so the same call would work on one backend
    and fail on another; a lone surrogate cannot be encoded for any driver.
    """
    if "\x00" in text:
        raise ValueError(f"{what} must not contain NUL characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} must be valid Unicode (no lone surrogates)") from None
    return text


def check_name(name: object) -> str:
    """Return ``name`` if it can be a lock name; raise TypeError/ValueError otherwise.

    Names are compared exactly on every backend, so no normalisation happens here: two
    Unicode spellings of one word are two locks, as they are two keys in a dict.
    """
    if not isinstance(name, str):
        raise TypeError(f"lock name must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError("lock name must not be empty")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(
            f"lock name is {len(name)} characters long; at most {MAX_NAME_LENGTH} are allowed"
        )
    return _check_characters(name, "lock name")


# The row names of semaphores (``name#permits``, ``name#permit:<i>``: distlock/semaphores.py)
# and read/write locks (``name#rw``, ``name#write``, ``name#read:<i>``: distlock/rwlocks.py).
_RESERVED_ROW = re.compile(r"#(?:permits|permit:[0-9]+|rw|write|read:[0-9]+)\Z")


def refuse_reserved(name: str) -> None:
    """Raise ValueError if ``name`` is a row name of a semaphore or read/write lock.

    A plain lock of such a name would share that row: its grant would take a permit the
    semaphore does not count, or bypass the read/write lock's writer preference. Those
    rows stay readable (``lock_status``) and breakable (``break_lock``); only taking them
    as plain locks is refused. The check costs a ``"#" in name`` for almost every name.
    """
    if "#" in name and _RESERVED_ROW.search(name):
        raise ValueError(
            f"lock name {name!r} ends in a suffix reserved for the rows of semaphores and "
            "read/write locks (#permits, #permit:<n>, #rw, #write, #read:<n>): take it "
            "with semaphore()/read_lock()/write_lock(), or choose another name"
        )


def check_lock_name(name: object) -> str:
    """check_name() for a plain lock: a semaphore's or read/write lock's row name is
    refused too (:func:`refuse_reserved`)."""
    checked = check_name(name)
    refuse_reserved(checked)
    return checked


def check_text(value: object, what: str) -> str:
    """Return ``value`` if it can be stored in a text column for people to read.

    For ``holder=`` and ``break_lock(by=)``: any length (they are cut to their column's
    length where they are stored), but a str, without NUL or lone surrogates, checked
    before any SQL so that a lock is not broken or granted first and the write of the
    description fails afterwards.
    """
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    return _check_characters(value, what)


def _describe(value: int | float | Decimal | timedelta) -> str:
    # A 400-digit int in an error message helps nobody.
    if isinstance(value, timedelta):
        return str(value)
    if isinstance(value, int) and abs(value) >= 10**15:
        return f"{Decimal(value):.3e} s"
    return f"{value} s"


def check_seconds(value: object, what: str, *, hint: str = "") -> float:
    """Return ``value`` (a number of seconds or a timedelta) as finite float seconds.

    Durations are limited to ±MAX_SECONDS, so that every one of them is a float, and a
    duration in microseconds added to a database time still fits the 64-bit integer
    columns and parameters (beyond that, SQLite raises OverflowError and the servers
    compute in numeric). ``hint`` is added to the message of an out-of-range value.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | Decimal | timedelta):
        raise TypeError(
            f"{what} must be a number of seconds or a timedelta, not {type(value).__name__}"
        )
    if isinstance(value, Decimal) and (value.is_nan() or value.is_infinite()):
        # float() of a signalling NaN raises a message that does not say which argument.
        raise ValueError(f"{what} must be finite, not {value}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} must be finite, not {value}")
    # An int too large for a float and a Decimal beyond its range are compared exactly,
    # before float() could raise OverflowError or give inf.
    seconds_exact = value.total_seconds() if isinstance(value, timedelta) else value
    if not -MAX_SECONDS <= seconds_exact <= MAX_SECONDS:
        raise ValueError(
            f"{what} of {_describe(value)} is out of range: durations are limited to "
            f"±{MAX_SECONDS:,} s (about 31,700 years)" + (f"; {hint}" if hint else "")
        )
    return float(seconds_exact)


def positive_seconds(value: object) -> bool:
    """Is ``value`` a setting's number of seconds: positive, finite, not a bool?"""
    # Compared, not passed to math.isfinite(), which raises OverflowError for an int too
    # large for a float; NaN fails both comparisons and infinity the upper bound.
    return (
        isinstance(value, int | float) and not isinstance(value, bool)
        and 0 < value <= MAX_SECONDS
    )


def check_ttl(ttl: object) -> float:
    """Return the lease length in seconds (the default when ``ttl`` is None)."""
    if ttl is None:
        ttl = conf.DEFAULT_TTL
    if (
        isinstance(ttl, int | float) and not isinstance(ttl, bool)
        and MIN_TTL <= ttl <= MAX_SECONDS and ttl <= float(conf.MAX_TTL)
    ):
        # The common case in a few comparisons (every acquire checks its ttl): a plain
        # number within bounds. NaN, infinities and anything out of range fail them and
        # get the full check below, with its messages.
        return float(ttl)
    seconds = check_seconds(ttl, "ttl")
    if seconds < MIN_TTL:
        raise ValueError(f"ttl must be at least {MIN_TTL} s, not {seconds}")
    max_ttl = float(conf.MAX_TTL)
    if seconds > max_ttl:
        raise ValueError(
            f"ttl of {seconds} s is longer than DISTLOCK_MAX_TTL ({max_ttl} s); "
            "use a shorter ttl with auto_renew=True for long work"
        )
    return seconds


def check_timeout(timeout: object) -> float | None:
    """Return the wait limit in seconds, or None for no limit."""
    if timeout is None:
        return None
    seconds = check_seconds(
        timeout, "timeout", hint="use timeout=None to wait without a limit"
    )
    if seconds < 0:
        raise ValueError(f"timeout must not be negative, not {seconds}")
    return seconds


def check_using(using: object) -> str:
    """Return the database alias for the lock table."""
    if using is None:
        return conf.database()
    if not isinstance(using, str):
        raise TypeError(f"using must be a database alias (str), not {type(using).__name__}")
    if using not in settings.DATABASES:
        raise ValueError(f"using={using!r} is not a database alias in settings.DATABASES")
    return using


def check_token_range(value: object, what: str) -> int:
    """Return ``value`` if it is an int from 1 to MAX_TOKEN: a token, or a number of
    tokens (the failover margin); ``what`` names it in the TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if not 1 <= value <= MAX_TOKEN:
        raise ValueError(f"{what} must be between 1 and {MAX_TOKEN}, not {value}")
    return value


def check_token(token: object) -> int:
    """Return ``token`` if it can be a fencing token."""
    return check_token_range(token, "token")


def check_owner(owner: object) -> str:
    """Return ``owner`` if it has the shape distlock gives owners (32 hex digits)."""
    if not isinstance(owner, str):
        raise TypeError(f"owner must be a str, not {type(owner).__name__}")
    if len(owner) != OWNER_LENGTH or any(c not in "0123456789abcdef" for c in owner):
        raise ValueError(
            f"owner must be the {OWNER_LENGTH} lowercase hex digits distlock generated"
        )
    return owner
