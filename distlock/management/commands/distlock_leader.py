"""Run CALLABLE (a dotted path, e.g. myapp.jobs.schedule) as the leader of election
NAME: campaign, call it with the term while elected, campaign again after a loss, until
SIGTERM or SIGINT. Exits 0 when stopped so, or when the callable returned while it led.

The callable gets a :class:`distlock.leader.Term`: it should loop on ``term.sleep(...)``
(False as soon as the term is over, or the command is told to stop) and fence its
writes with ``term.lease``. Each election and loss is written to stdout with its term.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.utils.module_loading import import_string

from distlock.leader import Term, run_as_leader
from distlock.management.commands._common import LockCommand, parse_seconds
from distlock.validation import check_name, check_ttl


class Command(LockCommand):
    def add_options(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="The election's lock name, exactly.")
        parser.add_argument("callable", help="Dotted path of the loop to run while leader.")
        parser.add_argument("--ttl", default="30", help="The leader's lease, seconds (30).")

    def run(self, alias: str, **options: Any) -> None:
        try:
            ttl = check_ttl(parse_seconds(options["ttl"], "--ttl"))
            name = check_name(options["name"])
        except (TypeError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        loop = _loop(options["callable"])
        stop = threading.Event()

        def stop_on(signum: int, frame: FrameType | None) -> None:
            self.stdout.write(f"{signal.Signals(signum).name}: stepping down")
            stop.set()

        previous = {sig: signal.signal(sig, stop_on) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            run_as_leader(
                name, loop, ttl=ttl, using=alias, holder=f"distlock_leader {name}",
                on_elected=lambda term: self.stdout.write(f"elected: term {term.token}"),
                on_lost=lambda term: self.stdout.write(f"lost: term {term.token}"),
                stop=stop,
            )
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.stdout.write("stopped" if stop.is_set() else "done: the loop returned")


def _loop(path: str) -> Callable[[Term], object]:
    """The callable at dotted ``path``, or CommandError (before any campaign)."""
    try:
        found = import_string(path)
    except ImportError as exc:
        raise CommandError(f"callable: cannot import {path!r}: {exc}") from exc
    if not callable(found):
        raise CommandError(f"callable: {path!r} is not callable")
    return found  # type: ignore[no-any-return]
