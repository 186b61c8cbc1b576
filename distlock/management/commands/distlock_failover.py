"""After a failover to an asynchronous standby: raise every lock's token and the token floor
by --margin (default 1,000,000,000) above the largest token so far, and end every lease, so
that no token the lost primary issued is issued again. Run it on the promoted server before
the application can reach it.

Thin over :func:`distlock.ops.failover.raise_tokens` (one transaction: all or nothing); the
runbook and how to choose the margin are in docs/deployment.md.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError

from distlock.exceptions import TokenExhausted
from distlock.management.commands._common import LockCommand, parse_int, who
from distlock.ops.failover import DEFAULT_MARGIN, check_margin, raise_tokens


class Command(LockCommand):
    def add_options(self, parser: CommandParser) -> None:
        # Parsed in run(), not by argparse (type=int), whose error exits with status 2.
        parser.add_argument(
            "--margin", default=str(DEFAULT_MARGIN),
            help="How far above the largest token so far the next grants start: more than "
            "the grants the lost primary can have made that this server never received.",
        )

    def run(self, alias: str, **options: Any) -> None:
        margin = options["margin"]
        if isinstance(margin, str):  # call_command() may also pass an int
            margin = parse_int(margin, "--margin")
        try:
            margin = check_margin(margin)
            raised = raise_tokens(margin=margin, using=alias, by=who("distlock_failover"))
        except (TypeError, ValueError) as exc:
            raise CommandError(f"--margin: {exc}") from exc
        except TokenExhausted as exc:
            raise CommandError(str(exc)) from exc
        except DatabaseError as exc:
            raise CommandError(
                f"could not raise the tokens on database {alias!r}, nothing was changed: "
                f"{exc}".rstrip() + " (is this the promoted primary?)"
            ) from exc
        self.stdout.write(self.style.SUCCESS(
            f"Raised the token of {raised.rows} lock row(s) and the token floor to "
            f"{raised.floor} (largest token before: {raised.previous}, margin {margin}); "
            f"ended {len(raised.ended)} held lease(s). Every grant from now on gets a "
            f"token above {raised.floor}."
        ))
        for name, _, token, holder in raised.ended:
            self.stdout.write(f"  ended {name!r} (token {token}, holder {holder or '?'})")
