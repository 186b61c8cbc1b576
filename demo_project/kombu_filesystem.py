"""kombu's filesystem transport with messages and exchange tables that appear whole.

kombu (5.7) writes a message by creating its file in the queue folder and then writing
it, while a consumer takes any file in that folder (moves it away and reads it) without
waiting: a worker can read an empty or half-written message, raise JSONDecodeError and
stop, and the message is gone. Seen in the demo under load. Here the message is written
to a hidden temporary file beside it and renamed into place, which is atomic on one
filesystem, so a consumer only ever sees complete messages.

Binding a queue has the same kind of race: kombu creates an exchange's table file
(truncating) before it locks it, so a second worker starting at the same moment can lock
the new, empty file first and die reading it (JSONDecodeError; seen in CI with the demo's
workers). Here the file is created without truncation and read only under the lock, and
an empty table file counts as an empty table.

Importing this module makes the ``filesystem://`` URL use this transport in this process
(the demo's and the tests' Celery apps import it, in the producer and in every worker).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        # Same name scheme as kombu's (it orders the queue); the temporary name starts
        # with a dot, which no consumer takes for a message of any queue.
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        fd, temporary = tempfile.mkstemp(dir=self.data_folder_out, prefix=".", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(str_to_bytes(dumps(payload)))
            os.replace(temporary, os.path.join(self.data_folder_out, name))
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise ChannelError(f"Cannot add message {name!r} to the queue folder") from exc

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        file = self._exchange_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        entry = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc
        with os.fdopen(fd, "r+b", buffering=0) as table:
            filesystem.lock(table, filesystem.LOCK_EX)
            try:
                queues = _entries(table.read())
                if entry not in queues:
                    table.seek(0)
                    table.truncate()
                    table.write(str_to_bytes(dumps([entry, *queues])))
            finally:
                filesystem.unlock(table)

    def get_table(self, exchange: str) -> list[Any]:
        file = self._exchange_file(exchange)
        try:
            with open(file, "rb") as table:
                filesystem.lock(table, filesystem.LOCK_SH)
                try:
                    return _entries(table.read())
                finally:
                    filesystem.unlock(table)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc


def _entries(content: bytes) -> list[Any]:
    """The queues of an exchange table file; empty until its creator has written it."""
    if not content:
        return []
    return [filesystem.exchange_queue_t(*entry) for entry in loads(bytes_to_str(content))]


class Transport(filesystem.Transport):
    Channel = Channel


TRANSPORT_ALIASES["filesystem"] = f"{__name__}:Transport"
