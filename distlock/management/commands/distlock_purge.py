"""Delete lock rows free or expired for at least --idle (default 1d), enqueue_once's task
keys idle as long, and audit events older than --events-older-than (default
DISTLOCK_AUDIT_RETENTION; with audit off, only when given). Durations: seconds or 90s,
15m, 12h, 7d, 2w. --dry-run counts what would be deleted and deletes nothing.

Thin over :func:`distlock.purge_locks` (which raises the token floor to every token it
deletes, so a purged name that comes back still gets a higher token) and
:func:`distlock.ops.audit.purge_events`; both delete in short batches. A dry run counts
with the same conditions, by the same database clock (one count per table, which reads
the rows a purge would read): the rows that become idle in between, or that a holder
takes again, make the real purge differ by that much.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import CommandError, CommandParser

from distlock.conf import conf
from distlock.core.purge import purge_locks
from distlock.core.status import database_now, duration
from distlock.integrations.unique import count_idle_task_keys, purge_task_keys
from distlock.management.commands._common import LockCommand, parse_duration
from distlock.models import Lock, LockEvent
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
        parser.add_argument(
            "--dry-run", action="store_true",
            help="Say how many lock rows and audit events would be deleted; delete nothing.",
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
        dry = options["dry_run"]
        idle_words = duration(idle.total_seconds())
        idle_us = round(idle.total_seconds() * 1e6)
        if dry:
            # purge_look's condition (backends/floor.py): free or expired at least idle.
            cutoff = database_now(alias) - idle_us
            would = Lock.objects.using(alias).filter(expires_us__lte=cutoff).count()
            self.stdout.write(f"Would delete {would} lock row(s) idle for at least "
                              f"{idle_words} (dry run: nothing deleted).")
            keys = count_idle_task_keys(idle_us, alias)
        else:
            locks = purge_locks(idle=idle, using=alias)
            self.stdout.write(f"Deleted {locks} lock row(s) idle for at least {idle_words}.")
            keys = purge_task_keys(idle=idle, using=alias)
        # enqueue_once's key rows, idle as long: a line only when there are any, so a site
        # that does not use enqueue_once reads nothing about it.
        if keys:
            verb = "Would delete" if dry else "Deleted"
            self.stdout.write(f"{verb} {keys} task key(s) idle for at least {idle_words}.")
        # With audit off there is no history to keep tidy (unless asked for by age): a
        # line about audit events would only puzzle a site that never turned it on.
        if options["skip_events"] or (events is None and not conf.AUDIT):
            return
        if events is None and retention() is None:
            kept = "Would keep" if dry else "Kept"
            self.stdout.write(f"{kept} all audit events (DISTLOCK_AUDIT_RETENTION is None).")
            return
        age = events if events is not None else timedelta(seconds=retention() or 0)
        age_words = duration(age.total_seconds())
        if dry:
            # purge_events' cutoff: older than age by the database clock.
            cutoff = database_now(alias) - round(age.total_seconds() * 1e6)
            would = LockEvent.objects.using(alias).filter(at_us__lt=cutoff).count()
            self.stdout.write(f"Would delete {would} audit event(s) older than {age_words}.")
            return
        deleted = purge_events(older_than=age, using=alias)
        self.stdout.write(f"Deleted {deleted} audit event(s) older than {age_words}.")
