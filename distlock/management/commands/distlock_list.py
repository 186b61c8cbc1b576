"""List locks: name, state (held / expired / free by the database clock), token, holder,
expiry and renewal count.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import CommandParser

from distlock.management.commands._common import LockCommand
from distlock.status import FREE, HELD, describe, locks, relative

COLUMNS = ["name", "state", "token", "holder", "expires", "renews"]


class Command(LockCommand):
    def add_options(self, parser: CommandParser) -> None:
        parser.add_argument("--held", action="store_true", help="Only locks held right now.")
        parser.add_argument(
            "--json", action="store_true", help="Print a JSON list (one object per lock)."
        )

    def run(self, alias: str, **options: Any) -> None:
        rows = locks(alias).order_by("name")
        if options["held"]:
            rows = rows.filter(state=HELD)
        if options["json"]:
            self.stdout.write(json.dumps([describe(row) for row in rows], indent=2))
            return
        table = [
            [
                row.name, row.state, str(row.token), row.holder,
                "" if row.state == FREE else relative(row.expires_us, row.db_now_us),
                str(row.renew_count),
            ]
            for row in rows
        ]
        if not table:
            self.stdout.write("No locks held." if options["held"] else "No locks.")
            return
        widths = [max(len(line[i]) for line in [COLUMNS, *table]) for i in range(len(COLUMNS))]
        for line in [COLUMNS, *table]:
            cells = (cell.ljust(width) for cell, width in zip(line, widths, strict=True))
            self.stdout.write("  ".join(cells).rstrip())
