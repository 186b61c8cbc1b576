"""Break lock NAME: free it now, so the next grant gets a higher token and the holder's
renew, release and fenced writes fail. With --owner/--token only that grant is broken.
Exits non-zero when nothing was broken.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from distlock.core.locks import break_lock
from distlock.management.commands._common import LockCommand, parse_int, who
from distlock.models import Lock
from distlock.validation import check_name


class Command(LockCommand):
    def add_options(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The lock name, exactly.")
        parser.add_argument("--owner", help="Break only if this owner (32 hex) holds it.")
        # Parsed in handle(), not by argparse (type=int), whose error exits with status 2.
        parser.add_argument("--token", help="Break only if this is its token.")

    def run(self, alias: str, **options: Any) -> None:
        token = options["token"]
        if isinstance(token, str):  # call_command() may also pass an int
            token = parse_int(token, "--token")
        try:
            name = check_name(options["name"])
            broken = break_lock(
                name, owner=options["owner"], token=token, using=alias, by=who("distlock_break")
            )
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        if broken:
            self.stdout.write(self.style.SUCCESS(
                f"Broke lock {name!r}. Its holder's renew, release and fenced writes will "
                "fail; the next grant gets a higher token."
            ))
            return
        row = Lock.objects.using(alias).filter(name=name).first()
        if row is None:
            raise CommandError(f"There is no lock named {name!r}.")
        if row.is_free:
            raise CommandError(f"Lock {name!r} is not held (token {row.token}); nothing broken.")
        raise CommandError(
            f"Lock {name!r} is held by another grant (owner {row.owner}, token {row.token}) "
            "than --owner/--token say; nothing broken."
        )
