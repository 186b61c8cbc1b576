"""List locks: name, state (held / expired / free by the database clock), token, holder,
expiry ("in 59 min", "12 s ago") and renewal count. --watch [SECONDS] prints the table
again every SECONDS (default 2) until Ctrl-C.
"""

from __future__ import annotations

import json
import time
from typing import Any

from django.core.management.base import CommandError, CommandParser

from distlock.db import db_now_us
from distlock.management.commands._common import LockCommand, parse_seconds
from distlock.status import FREE, HELD, describe, locks, relative, state_is

COLUMNS = ["name", "state", "token", "holder", "expires", "renews"]
WATCH_SECONDS = 2.0
# The shortest pause between tables: a watch must not turn into a busy loop on the lock
# table (each table is one scan of it).
WATCH_MIN = 0.2


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

    def run(self, alias: str, **options: Any) -> None:
        every = self._watch_seconds(options["watch"], options["json"])
        if every is None:
            self.stdout.write(self._table(alias, options["held"], options["json"]))
            return
        try:
            while True:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                table = self._table(alias, options["held"], False)
                self.stdout.write(f"{stamp}  (every {every:g} s; Ctrl-C stops)\n{table}\n")
                self.stdout.flush()
                time.sleep(every)
        except KeyboardInterrupt:
            # Ctrl-C is how a watch ends: a clean exit, not a traceback or status 1.
            self.stdout.write("")

    @staticmethod
    def _watch_seconds(raw: str | None, as_json: bool) -> float | None:
        if raw is None:
            return None
        if as_json:
            raise CommandError("--watch prints tables for people; it does not go with --json")
        seconds = parse_seconds(raw, "--watch")
        if seconds < WATCH_MIN:
            raise CommandError(f"--watch: {raw!r} is too short; at least {WATCH_MIN:g} s")
        return seconds

    def _table(self, alias: str, held: bool, as_json: bool) -> str:
        rows = locks(alias).order_by("name")
        if held:
            # Columns against one clock reading: the owned rows' index can serve it.
            rows = rows.filter(state_is(HELD, db_now_us(alias)))
        if as_json:
            return json.dumps([describe(row) for row in rows], indent=2)
        table = [
            [
                row.name, row.state, str(row.token), row.holder,
                "" if row.state == FREE else relative(row.expires_us, row.db_now_us),
                str(row.renew_count),
            ]
            for row in rows
        ]
        if not table:
            return "No locks held." if held else "No locks."
        widths = [max(len(line[i]) for line in [COLUMNS, *table]) for i in range(len(COLUMNS))]
        return "\n".join(
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
            .rstrip()
            for line in [COLUMNS, *table]
        )
