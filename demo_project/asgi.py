"""The demo's ASGI application: ``uvicorn demo_project.asgi:application``.

Serves the same project as ``manage.py runserver``, including the async deposit view
(demo_project/bank/views.py), whose lock waits never hold a thread.
"""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "demo_project.settings")

application = get_asgi_application()
