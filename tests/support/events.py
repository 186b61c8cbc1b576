"""Events that task bodies in worker processes record, and the test reading them back.

A task (Celery's, Django Tasks') appends one JSON line per event to ``events.jsonl`` in a
folder the test gave its workers, stamped with the pid and the database clock. One
``write`` per line with O_APPEND, so lines from several processes never interleave. The
test reads them with deadlines (:class:`Events`) and signals the tasks by creating files
in the same folder (:func:`wait_for_file`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Event = dict[str, Any]


def record(folder: Path, kind: str, **data: Any) -> None:
    """Append one event line, stamped with the pid and the database clock."""
    from distlock.db import db_now_us

    line = json.dumps({"kind": kind, "pid": os.getpid(), "db_us": db_now_us("default"), **data})
    fd = os.open(folder / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def wait_for_file(path: Path, timeout: float = 60.0) -> bool:
    """Block until the test creates ``path`` (a go signal); False after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Events:
    """The events.jsonl the tasks append to, read with deadlines."""

    def __init__(self, base: Path) -> None:
        self.path = base / "events.jsonl"

    def all(self, **match: Any) -> list[Event]:
        if not self.path.exists():
            return []
        events = [json.loads(line) for line in self.path.read_text().splitlines() if line]
        return [e for e in events if all(e.get(k) == v for k, v in match.items())]

    def wait(self, count: int = 1, timeout: float = 30.0,
             where: Callable[[Event], bool] | None = None, **match: Any) -> list[Event]:
        """At least ``count`` events matching ``match`` (and ``where``), within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.all(**match) if where is None or where(e)]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"wanted {count} event(s) {match} within {timeout} s, got {len(found)}; "
                    f"all events: {self.all()}"
                )
            time.sleep(0.05)
