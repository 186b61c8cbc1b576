"""The demo's Celery app: ``celery -A demo_project.celery worker``.

Configured from the Django settings' ``CELERY_*`` names; tasks come from the installed
apps' ``tasks`` modules (demo_project/bank/tasks.py).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from celery import Celery, signals

from demo_project import kombu_filesystem  # noqa: F401 - filesystem:// writes atomically

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")

app = Celery("demo_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def prepare_broker_folders() -> None:
    """Create the filesystem broker's folders (kombu does not) and keep moves atomic.

    The transport takes a message by moving its file into the temporary directory; on
    another filesystem that move is a copy and a delete, and two workers could both get
    the message. So the temporary directory goes beside the queue folder.
    """
    from django.conf import settings

    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", None) or {}
    if not str(settings.CELERY_BROKER_URL).startswith("filesystem://") or not options:
        return
    base = Path(settings.DEMO_BROKER_DIR)
    for folder in (options["data_folder_in"], options["control_folder"], base / "tmp"):
        Path(folder).mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(base / "tmp")


@signals.worker_init.connect
def _worker_init(**kwargs: Any) -> None:
    prepare_broker_folders()


@signals.worker_ready.connect
def _worker_ready(sender: Any = None, **kwargs: Any) -> None:
    # contention_demo waits for one such file per worker it started.
    folder = os.environ.get("DEMO_READY_DIR")
    if folder:
        (Path(folder) / f"ready-{os.getpid()}").write_text(sender.hostname)
