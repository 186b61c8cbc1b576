"""distlock.core.status's words for durations: the one place seconds become "59 min"."""

from __future__ import annotations

import pytest

from distlock.core.status import duration, relative


@pytest.mark.parametrize(
    ("seconds", "words"),
    [
        (0, "0 s"), (0.4, "0 s"), (12, "12 s"), (59.4, "59 s"), (59.6, "1 min"),
        (60, "1 min"), (3562, "59 min"), (3599.9, "59 min"), (3600, "1 h"),
        (3661, "1 h 1 min"), (7200, "2 h"), (86399, "23 h 59 min"), (86400, "1 day"),
        (90000, "1 day 1 h"), (2 * 86400 + 7 * 3600 + 59, "2 days 7 h"), (-12, "12 s"),
    ],
)
def test_duration_in_words(seconds, words):
    assert duration(seconds) == words


@pytest.mark.parametrize(
    ("at_s", "words"),
    [(3562, "in 59 min"), (-12, "12 s ago"), (0.2, "now"), (-0.4, "now"), (-86400, "1 day ago")],
)
def test_relative_in_words(at_s, words):
    assert relative(round(at_s * 1e6) + 10**15, 10**15) == words


def test_relative_of_an_unknown_time_is_empty():
    assert relative(None, 5) == relative(5, None) == ""
