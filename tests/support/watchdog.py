"""An emulated watchdog device for Patroni's ``driver: testing`` (tests/test_patroni.py).

Patroni's watchdog (``watchdog: {mode: required}``) is what fences a leader whose machine
stalls: Patroni arms the device when it takes the leader key and sends a keepalive every
HA loop; if the keepalives stop for the device's timeout (``ttl - safety_margin``), the
device resets the machine, before the leader key can expire and another member be
promoted. The kernel's softdog cannot be used here: there is no ``/dev/watchdog`` in the
test machine, and a real reset would reboot a machine other runs share.

Patroni ships a device for tests (``patroni/watchdog/linux.py``,
``TestingWatchdogDevice``): instead of ioctls it writes ``Ctimeout=N\\n`` when it sets
the timeout, ``1`` for a keepalive and ``V`` (the magic close) when it disarms it, to the
``device`` path, here a named pipe. :class:`Watchdog` reads that pipe in a thread of the
test process and, when no keepalive came within the timeout, does what the reset would do
to the member: ``reset`` (the harness's: SIGKILL its Patroni and every process of its
PostgreSQL; SIGKILL also ends a SIGSTOPped process).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Watchdog:
    """The device at ``path`` (a FIFO made by :meth:`start`) calling ``reset`` on expiry."""

    path: Path
    reset: Callable[[], None]
    #: Wall-clock times (time.time()) of each reset: when the machine would have rebooted.
    resets: list[float] = field(default_factory=list)
    #: The timeout Patroni set last (seconds), 0 until it armed the device.
    timeout: float = 0.0
    _deadline: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _fds: list[int] = field(default_factory=list)

    def start(self, owner: tuple[int, int] | None = None) -> None:
        """Make the FIFO (owned by ``owner`` (uid, gid), Patroni's account) and read it.

        The thread also holds the FIFO open for writing itself: Patroni's ``open``
        (O_WRONLY) then never blocks, and its close is no end of file to the reader."""
        if not self.path.exists():
            os.mkfifo(self.path, 0o600)
        if owner is not None:
            os.chown(self.path, *owner)
        reader = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._fds = [reader, os.open(self.path, os.O_WRONLY)]
        self._thread = threading.Thread(target=self._watch, args=(reader,), daemon=True,
                                        name=f"watchdog {self.path}")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

    @property
    def armed(self) -> bool:
        return self._deadline is not None

    def _feed(self, data: bytes) -> None:
        """Apply what Patroni wrote: a timeout (arms), keepalives, a magic close."""
        for match in re.finditer(rb"Ctimeout=(\d+)\n|[1V]", data):
            if match.group(1) is not None:
                self.timeout = float(match.group(1))
                self._deadline = time.monotonic() + self.timeout
            elif match.group(0) == b"V":
                self._deadline = None
            elif self.timeout:
                self._deadline = time.monotonic() + self.timeout

    def _watch(self, reader: int) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select([reader], [], [], 0.05)
            if readable:
                with contextlib.suppress(BlockingIOError):
                    self._feed(os.read(reader, 4096))
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                # The machine resets: once, and the device is disarmed with it.
                self._deadline = None
                self.resets.append(time.time())
                self.reset()
