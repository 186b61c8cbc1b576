"""kombu's filesystem transport with messages that appear whole.

kombu (5.7) writes a message by creating its file in the queue folder and then writing
it, while a consumer takes any file in that folder (moves it away and reads it) without
waiting: a worker can read an empty or half-written message, raise JSONDecodeError and
stop, and the message is gone. Seen in the demo under load. Here the message is written
to a hidden temporary file beside it and renamed into place, which is atomic on one
filesystem, so a consumer only ever sees complete messages.

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
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


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


class Transport(filesystem.Transport):
    Channel = Channel


TRANSPORT_ALIASES["filesystem"] = f"{__name__}:Transport"
