"""Delete lock rows free or expired for at least --idle (default 1d) and audit events older
than --events-older-than (default DISTLOCK_AUDIT_RETENTION; with audit off, only when
given). Durations: seconds or 90s, 15m, 12h, 7d, 2w.

Thin over :func:`distlock.purge_locks` (which raises the token floor to every token it
deletes, so a purged name that comes back still gets a higher token) and
:func:`distlock.ops.audit.purge_events`; both delete in short batches.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import CommandError, CommandParser

from distlock.conf import conf
from distlock.core.purge import purge_locks
from distlock.core.status import duration
from distlock.management.commands._common import LockCommand, parse_duration
from distlock.ops.audit import purge_events, retention


class Command(LockCommand):
    # Each command declares its options as argparse calls, alike in shape, different in
    # content (distlock_list's): the common ones (--database) are in _common.LockCommand.
    def add_options(self, parser: CommandParser) -> None:
        parser.add_argument("--idle", default="1d", help="Minimum idle time of a lock row.")
        parser.add_argument(
            "--events-older-than", dest="events", help="Age of audit events to delete."
        )
        parser.add_argument(
            "--skip-events", action="store_true", help="Leave the audit history alone."
        )

    def run(self, alias: str, **options: Any) -> None:
        idle = parse_duration(options["idle"], "--idle")
        events = None
        if options["events"] is not None:
            if options["skip_events"]:
                raise CommandError("--events-older-than and --skip-events contradict each other")
            events = parse_duration(options["events"], "--events-older-than")
        elif not options["skip_events"]:
            try:
                retention()
            except (TypeError, ValueError) as exc:
                raise CommandError(str(exc)) from exc
        # Everything is checked before anything is deleted (parse_duration keeps both
        # durations within what purge_locks and purge_events accept).
        locks = purge_locks(idle=idle, using=alias)
        self.stdout.write(
            f"Deleted {locks} lock row(s) idle for at least {duration(idle.total_seconds())}."
        )
        # With audit off there is no history to keep tidy (unless asked for by age): a
        # line about audit events would only puzzle a site that never turned it on.
        if options["skip_events"] or (events is None and not conf.AUDIT):
            return
        if events is None and retention() is None:
            self.stdout.write("Kept all audit events (DISTLOCK_AUDIT_RETENTION is None).")
            return
        age = events if events is not None else timedelta(seconds=retention() or 0)
        deleted = purge_events(older_than=age, using=alias)
        self.stdout.write(
            f"Deleted {deleted} audit event(s) older than {duration(age.total_seconds())}."
        )
