"""The lock table's admin pages on a small and a large table (part of benchmarks/rows.py).

Server time through Django's test client (no network, no browser), warm: each page is
fetched twice first, then timed ``repeat`` times; the figure is the median. Also the
module's ``urlpatterns`` (the benchmark's ROOT_URLCONF).
"""

from __future__ import annotations

import statistics
import time
from typing import Any


def __getattr__(name: str) -> Any:
    """``urlpatterns``, made when Django first asks (the admin site needs the app
    registry, which is not ready when rows.py imports this module)."""
    if name != "urlpatterns":
        raise AttributeError(name)
    from django.contrib import admin
    from django.urls import path

    return [path("admin/", admin.site.urls)]

APPS = ["django.contrib.admin", "django.contrib.auth", "django.contrib.sessions",
        "django.contrib.messages"]

SETTINGS: dict[str, Any] = {
    "ROOT_URLCONF": "benchmarks.rows_admin",
    "ALLOWED_HOSTS": ["*"],
    "MIDDLEWARE": [
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.middleware.common.CommonMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
    ],
    "TEMPLATES": [{
        "BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
        "OPTIONS": {"context_processors": [
            "django.template.context_processors.request",
            "django.contrib.auth.context_processors.auth",
            "django.contrib.messages.context_processors.messages",
        ]},
    }],
}


def pages() -> dict[str, str]:
    from django.contrib.admin.utils import quote
    from django.urls import reverse

    changelist = reverse("admin:distlock_lock_changelist")
    return {
        "Locks changelist": changelist,
        "state = held": f"{changelist}?state=held",
        "state = free": f"{changelist}?state=free",
        "search a name": f"{changelist}?q=hot%3A042",
        "a lock's page": reverse("admin:distlock_lock_change", args=[quote("hot:042")]),
    }


def time_pages(db_alias: str, repeat: int) -> dict[str, float]:
    """Median milliseconds of each page, with the lock table on ``db_alias``."""
    from django.contrib.auth.models import User
    from django.test import Client, override_settings

    user = User.objects.filter(username="bench").first() or User.objects.create_superuser(
        "bench", "bench@example.com", "bench")
    client = Client()
    client.force_login(user)
    got = {}
    with override_settings(DISTLOCK_DATABASE=db_alias):
        for label, url in pages().items():
            times = []
            for i in range(repeat + 2):
                started = time.perf_counter()
                response = client.get(url)
                took = (time.perf_counter() - started) * 1000
                assert response.status_code == 200, (url, response.status_code)
                if i >= 2:
                    times.append(took)
            got[label] = statistics.median(times)
    return got
