"""The ``lock`` label of the metrics: a lock name's pattern, from a configurable function.

A label value per lock name would make one time series per invoice, account or report
(Prometheus keeps every series it ever saw in memory), so the metrics are labelled by
``DISTLOCK_METRICS_NAME_PATTERN(name)``: by default :func:`name_pattern`. This module
does not import prometheus_client, so the system check can use it anywhere.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable

from django.utils.module_loading import import_string

from distlock.conf import conf

logger = logging.getLogger("distlock.metrics")

# The label of a name the configured function could not turn into a pattern (it raised
# or returned something else than a str): the event is still counted.
INVALID = "<invalid>"
# Patterns longer than this are cut: a label value is kept in every series of the metric.
MAX_PATTERN = 100
# How many names' patterns are remembered per function (the function runs once per name,
# not once per event; a bounded memo, as lock names are not).
MEMO_SIZE = 4096

_DIGITS = re.compile(r"[0-9]+")


def name_pattern(name: str) -> str:
    """The default pattern of lock name ``name``: its kind, with the key replaced by ``*``.

    The rule: the text before the first ``:`` is kept and the rest becomes ``*``
    (``invoice:42`` -> ``invoice:*``, ``report:7:2025`` -> ``report:*``); then every run of
    digits in what is kept becomes ``*`` (``shard12:x`` -> ``shard*:*``,
    ``rebuild-2025-01`` -> ``rebuild-*-*``); the result is cut to 100 characters. So the
    number of label values is the number of kinds of lock the code names — bounded, as
    long as names follow distlock's ``kind:key`` convention with the data after the
    colon. A name that carries data without a colon (``a3f9c2e1``) keeps its letters:
    name such locks ``kind:key``, or set ``DISTLOCK_METRICS_NAME_PATTERN`` to a function
    of your own.
    """
    kind, colon, _ = name.partition(":")
    return (_DIGITS.sub("*", kind) + (colon and ":*"))[:MAX_PATTERN]


@functools.cache
def _resolved(path: str) -> Callable[[str], str]:
    """The function at dotted ``path``, its results memoised per name."""
    function: Callable[[str], str] = import_string(path)
    return functools.lru_cache(maxsize=MEMO_SIZE)(function)


def pattern_function() -> Callable[[str], str]:
    """The configured pattern function; ImportError if the dotted path does not import."""
    path = conf.METRICS_NAME_PATTERN
    if not isinstance(path, str):
        raise TypeError(
            f"DISTLOCK_METRICS_NAME_PATTERN must be a dotted path (str), not {path!r}"
        )
    return _resolved(path)


def pattern_of(name: str) -> str:
    """The ``lock`` label of ``name``; never raises (it runs inside lock operations).

    A receiver that raised would hand the caller an exception for a lock it holds, so a
    broken setting (reported by the system check distlock.E030/E031 at start-up) is
    logged here and the event counted under ``<invalid>``.
    """
    try:
        value = pattern_function()(name)
    except Exception:
        logger.exception("DISTLOCK_METRICS_NAME_PATTERN failed for lock %r", name)
        return INVALID
    if not isinstance(value, str):
        logger.error(
            "DISTLOCK_METRICS_NAME_PATTERN returned %r for lock %r, not a str", value, name
        )
        return INVALID
    return value[:MAX_PATTERN]


def setting_problem() -> tuple[str, str] | None:
    """What is wrong with DISTLOCK_METRICS_NAME_PATTERN, for the system check: ``"path"``
    (no function there) or ``"function"`` (it fails on a name), and the message; or None.

    The function is tried on a sample name: a function that imports but returns no str
    would otherwise fail at every lock event.
    """
    path = conf.METRICS_NAME_PATTERN
    if not isinstance(path, str):
        return "path", f"it must be a dotted path (str), not {path!r}"
    try:
        function = import_string(path)
    except ImportError as exc:
        return "path", f"{path!r} does not import: {exc}"
    if not callable(function):
        return "path", f"{path!r} is not callable"
    try:
        value = function("invoice:42")
    except Exception as exc:  # noqa: BLE001 - any failure is the setting's problem
        return "function", f"{path}('invoice:42') raised {type(exc).__name__}: {exc}"
    if not isinstance(value, str):
        return "function", f"{path}('invoice:42') returned {value!r}, not a str"
    return None
