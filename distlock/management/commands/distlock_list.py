"""List locks: name, state (held / expired / free by the database clock), token, holder,
expiry ("in 59 min", "12 s ago") and renewal count, in name order, the first --limit
(default 1000; 0: all) of them. --prefix P lists the names starting with P (=P: that name
only). --watch [SECONDS] shows the table again every SECONDS (default 2) until Ctrl-C.

On a terminal --watch redraws one screen (cursor home, clear to the end of the screen):
the table fits the terminal's width (the holder's middle is elided, so its host and its
"pid=… thread=…" end stay) and its height (the rows that do not fit are counted). To a
pipe or a file it appends each table after a blank line and a time stamp, full width and
without escape codes, so a log stays readable and greppable. Each table is stamped with
the database clock in the site's time zone, the zone written beside it.

The limit is there because a lock table grows with the business: printing a million rows
took 36 s on PostgreSQL (docs/performance.md). How many rows it left out is counted up to
MORE_CAP only, so the count stays cheap too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db.models import QuerySet

from distlock.admin.search import search
from distlock.core.status import FREE, HELD, LockWithState, describe, locks, relative, state_is
from distlock.db import db_now_us
from distlock.management.commands._common import (
    LockCommand,
    local_time,
    parse_int,
    parse_seconds,
    quoted,
)

COLUMNS = ["name", "state", "token", "holder", "expires", "renews"]
WATCH_SECONDS = 2.0
# The shortest pause between tables: a watch must not turn into a busy loop on the lock
# table (each table is one scan of it).
WATCH_MIN = 0.2
# The longest pause between tables: longer than time.sleep() accepts (about 292 years)
# was a traceback after the first table, and nobody watches a table once a day.
WATCH_MAX = 86_400.0
LIMIT = 1000
# The largest --limit: the count of the rest reads rows[limit:limit + MORE_CAP], and an
# OFFSET past a signed 64-bit integer was a DataError (PostgreSQL), a ProgrammingError
# (MariaDB) or an IntegrityError (SQLite) instead of a message. No table comes near it.
MAX_LIMIT = 10**18
# Rows past the limit are counted up to this many: "10,000 or more" is what an operator
# needs to know (narrow with --prefix), and the count reads at most this many rows.
MORE_CAP = 10_000
# --count: the most tables a watch prints before it ends by itself (for tests and
# scripts; a watch for people ends with Ctrl-C).
MAX_COUNT = 10**9
# Home the cursor, then clear to the end of the screen: the next table is drawn over the
# last one instead of below it (ECMA-48 CUP and ED, which every terminal emulator knows).
REDRAW = "\x1b[H\x1b[J"
# Lines of a watch screen that are not rows: the time stamp, the column heads, the
# "… and N more rows" line.
SCREEN_EXTRA = 3
# The narrowest a shrunk column gets before the line itself is cut: the holder's, then
# the name's, in that order (the holder is the longest and its middle matters least).
SHRINK = (("holder", 12), ("name", 12))


class Command(LockCommand):
    def add_options(self, parser: CommandParser) -> None:
        parser.add_argument("--held", action="store_true", help="Only locks held right now.")
        parser.add_argument(
            "--json", action="store_true", help="Print a JSON list (one object per lock)."
        )
        parser.add_argument(
            "--watch", nargs="?", const=str(WATCH_SECONDS), default=None, metavar="SECONDS",
            help=f"Print again every SECONDS (default {WATCH_SECONDS:g}) until Ctrl-C.",
        )
        # For tests and scripts (docs/reference/commands.md), not in --help.
        parser.add_argument("--count", default=None, help=argparse.SUPPRESS)
        parser.add_argument(
            "--limit", default=str(LIMIT), metavar="N",
            help=f"List at most N locks (default {LIMIT}; 0: all of them).",
        )
        parser.add_argument(
            "--prefix", default="", metavar="P",
            help="Only names starting with P (case-sensitive); =P: the name P only.",
        )

    def run(self, alias: str, **options: Any) -> None:
        every = self._watch_seconds(options["watch"], options["json"])
        limit = self._limit(options["limit"])
        count = self._count(options["count"], every)
        try:
            rows = search(locks(alias).order_by("name"), options["prefix"])
        except ValueError as exc:
            raise CommandError(f"--prefix: {exc}") from None
        if every is None:
            self.stdout.write(self._table(rows, alias, options["held"], options["json"], limit))
            return
        screen = self.stdout.isatty()
        shown = 0
        try:
            while True:
                head = f"{local_time(db_now_us(alias))}  (every {every:g} s; Ctrl-C stops)"
                if screen:
                    size = shutil.get_terminal_size()
                    lines = self._screen(rows, alias, options["held"], limit, size, head)
                    # No newline after the last line: on a full screen it would scroll
                    # the first line away.
                    self.stdout.write(REDRAW + "\n".join(lines), ending="")
                else:
                    table = self._table(rows, alias, options["held"], False, limit)
                    # A blank line after each table: where one ends is plain to see.
                    self.stdout.write(f"{head}\n{table}\n\n")
                self.stdout.flush()
                shown += 1
                if count is not None and shown >= count:
                    if screen:
                        self.stdout.write("")
                    return
                time.sleep(every)
        except KeyboardInterrupt:
            # Ctrl-C is how a watch ends: a clean exit, not a traceback or status 1.
            self.stdout.write("")

    def _screen(
        self, rows: QuerySet[LockWithState], alias: str, held: bool, limit: int | None,
        size: os.terminal_size, head: str,
    ) -> list[str]:
        """One watch screen: ``head``, then as many rows as the terminal has lines for,
        every line within its width."""
        room = max(1, size.lines - SCREEN_EXTRA)
        fits = room if limit is None else min(limit, room)
        why = "the terminal shows" if limit is None or room < limit else None
        text = self._table(rows, alias, held, False, fits, size.columns, why)
        return [fit_line(line, size.columns) for line in [head, *text.split("\n")]]

    @staticmethod
    def _watch_seconds(raw: object, as_json: bool) -> float | None:
        if raw is None:
            return None
        if as_json:
            raise CommandError("--watch prints tables for people; it does not go with --json")
        seconds = parse_seconds(raw, "--watch")
        if seconds < WATCH_MIN:
            raise CommandError(f"--watch: {raw!r} is too short; at least {WATCH_MIN:g} s")
        if seconds > WATCH_MAX:
            raise CommandError(
                f"--watch: {quoted(str(raw))} is too long; at most {WATCH_MAX:,g} s (a day)"
            )
        return seconds

    @staticmethod
    def _count(raw: object, every: float | None) -> int | None:
        if raw is None:
            return None
        count = parse_int(raw, "--count")
        if not 1 <= count <= MAX_COUNT:
            raise CommandError(f"--count: {quoted(str(raw))} is not between 1 and {MAX_COUNT:,}")
        if every is None:
            raise CommandError("--count: it goes with --watch (how many tables to print)")
        return count

    @staticmethod
    def _limit(raw: object) -> int | None:
        limit = parse_int(raw, "--limit")
        if limit < 0:
            raise CommandError(f"--limit: {quoted(str(raw))} is negative; 0 lists every lock")
        if limit > MAX_LIMIT:
            raise CommandError(
                f"--limit: {quoted(str(raw))} is too large; at most {MAX_LIMIT:,} "
                "(0 lists every lock)"
            )
        return limit or None

    def _table(
        self, rows: QuerySet[LockWithState], alias: str, held: bool, as_json: bool,
        limit: int | None, columns: int | None = None, why: str | None = None,
    ) -> str:
        if held:
            # Columns against one clock reading: the owned rows' index can serve it.
            rows = rows.filter(state_is(HELD, db_now_us(alias)))
        more = 0 if limit is None else int(rows[limit: limit + MORE_CAP].count())
        shown = list(rows if limit is None else rows[:limit])
        if as_json:
            # A list, as before: a script that needs every lock passes --limit 0; the
            # rows left out are said on stderr, so the output stays valid JSON.
            if more:
                self.stderr.write(self._more(more, limit))
            return json.dumps([describe(row) for row in shown], indent=2)
        table = [
            [
                row.name, row.state, str(row.token), row.holder,
                "" if row.state == FREE else relative(row.expires_us, row.db_now_us),
                str(row.renew_count),
            ]
            for row in shown
        ]
        if not table:
            return "No locks held." if held else "No locks."
        widths = [max(len(line[i]) for line in [COLUMNS, *table]) for i in range(len(COLUMNS))]
        if columns is not None:
            widths = fit_widths(widths, columns)
            table = [
                [elide(cell, width) for cell, width in zip(line, widths, strict=True)]
                for line in table
            ]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
            .rstrip()
            for line in [COLUMNS, *table]
        ]
        if more:
            lines.append(self._more(more, limit, why))
        return "\n".join(lines)

    @staticmethod
    def _more(more: int, limit: int | None, why: str | None = None) -> str:
        if more >= MORE_CAP:
            count = f"{MORE_CAP:,} or more rows"
        else:
            count = f"{more:,} more row" + ("" if more == 1 else "s")
        if why is not None:
            return f"… and {count} ({why} the first {limit:,}: --prefix narrows)"
        return (f"… and {count} (the first {limit:,} are listed: "
                "--prefix narrows, --limit 0 lists all)")


def elide(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, its middle replaced by "…": the start (a
    holder's host, a name's kind) and the longer end (``pid=… thread=…``, a name's key)
    stay visible."""
    if len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    head = (width - 1) // 3
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def fit_widths(widths: list[int], columns: int) -> list[int]:
    """Column widths that fit a line of ``columns`` characters (two spaces between
    columns): the holder's shrinks first, then the name's, each down to its minimum;
    what still does not fit is cut by :func:`fit_line`."""
    widths = list(widths)
    for column, narrowest in SHRINK:
        over = sum(widths) + 2 * (len(widths) - 1) - columns
        if over <= 0:
            break
        i = COLUMNS.index(column)
        widths[i] = max(min(widths[i], narrowest), widths[i] - over)
    return widths


def fit_line(line: str, columns: int) -> str:
    """``line`` cut to ``columns`` characters ("…" last), so the terminal never wraps it."""
    return line if len(line) <= columns else line[: max(columns - 1, 0)] + "…"[:columns]
