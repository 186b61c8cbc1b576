"""The lock table's admin pages on a small and a large table (part of benchmarks/rows.py).

Server time through Django's test client (no network, no browser), warm: each page is
fetched twice first, then timed ``repeat`` times; the figure is the median. Also the
module's ``urlpatterns`` (the benchmark's ROOT_URLCONF), and ``fill_events``, which
gives a table an audit history of a given size (``--events``) for the overview page and
the Lock events list.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
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
    events = reverse("admin:distlock_lockevent_changelist")
    timeline = reverse("admin:distlock_lock_timeline")
    # fill:0000042 has events in every history fill_events writes (names = the table's
    # rows, so at 1M rows and 10M events about 10 of them; at 1k, one in a thousand).
    return {
        "Locks changelist": changelist,
        "state = held": f"{changelist}?state=held",
        "state = expired": f"{changelist}?state=expired",
        "state = free": f"{changelist}?state=free",
        "search a name": f"{changelist}?q=hot%3A042",
        "a lock's page": reverse("admin:distlock_lock_change", args=[quote("hot:042")]),
        "a lock's page, with history": reverse("admin:distlock_lock_change",
                                               args=[quote("fill:0000042")]),
        "timeline of a lock": f"{timeline}?name=fill:0000042",
        "timeline of three locks": f"{timeline}?name=fill:0000042&name=fill:0000043"
                                   "&name=hot:042",
        "overview page": reverse("admin:distlock_overview"),
        "overview refresh (fragment)": reverse("admin:distlock_overview_fragment"),
        "Lock events changelist": events,
        "events: kind = stale write": f"{events}?kind=stale_write",
        "events: last hour": f"{events}?age=hour",
        "events: kind = stale write, last hour": f"{events}?kind=stale_write&age=hour",
        "events: kind = broken, last week (none)": f"{events}?kind=broken&age=week",
        "events search, 1 name (`fill:0000042`)": f"{events}?q=fill%3A0000042",
        "events search, =name (`=fill:0000042`)": f"{events}?q=%3Dfill%3A0000042",
        "events search, 1% of names (`fill:00`)": f"{events}?q=fill%3A00",
        "events search, every name (`fill:`)": f"{events}?q=fill%3A",
        "events search, no name (`zzz`)": f"{events}?q=zzz",
    }


# distlock_list's two forms: the default listing (the first 1,000 names, and a count of
# the rest up to 10,000) and the held ones (the owned rows' index).
COMMANDS = {"distlock_list --held": ["--held"], "distlock_list": []}


def time_commands(db_alias: str, repeat: int) -> dict[str, float]:
    """Median milliseconds of each of COMMANDS on ``db_alias`` (its output to memory)."""
    import io

    from django.core.management import call_command

    from distlock.models import Lock

    # Listing a million rows takes about a minute (its cost is the listing itself): once.
    whole_once = Lock.objects.using(db_alias).count() > 100_000
    got = {}
    for label, options in COMMANDS.items():
        times = []
        warm, timed = (0, 1) if whole_once and not options else (1, repeat)
        for i in range(warm + timed):
            out = io.StringIO()
            started = time.perf_counter()
            call_command("distlock_list", *options, "--database", db_alias, stdout=out)
            if i >= warm:
                times.append((time.perf_counter() - started) * 1000)
        got[label] = statistics.median(times)
    return got


# Events spread evenly over the last 30 days (the default retention) up to now, names
# from the idle rows, kinds in a grant's proportions; one stale write in a thousand.
_EVENTS = {
    "postgresql": "INSERT INTO distlock_lockevent (at_us, kind, name, token, owner, holder, "
                  "by, detail) SELECT {now} - (i::bigint * {step}), CASE WHEN i % 1000 = 7 "
                  "THEN 'stale_write' WHEN i % 3 = 0 THEN 'acquired' WHEN i % 3 = 1 THEN "
                  "'renewed' ELSE 'released' END, 'fill:' || lpad((i % {names})::text, 7, '0'),"
                  " 1, '', 'bench-holder', '', '' FROM generate_series(1, {count}) AS i",
    "mysql": "INSERT INTO distlock_lockevent (at_us, kind, name, token, owner, holder, `by`, "
             "detail) SELECT {now} - (seq * {step}), CASE WHEN seq % 1000 = 7 THEN "
             "'stale_write' WHEN seq % 3 = 0 THEN 'acquired' WHEN seq % 3 = 1 THEN 'renewed' "
             "ELSE 'released' END, CONCAT('fill:', LPAD(seq % {names}, 7, '0')), 1, '', "
             "'bench-holder', '', '' FROM seq_1_to_{count}",
    "sqlite": "WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s WHERE i < {count})"
              " INSERT INTO distlock_lockevent (at_us, kind, name, token, owner, holder, by, "
              "detail) SELECT {now} - (i * {step}), CASE WHEN i % 1000 = 7 THEN 'stale_write' "
              "WHEN i % 3 = 0 THEN 'acquired' WHEN i % 3 = 1 THEN 'renewed' ELSE 'released' "
              "END, 'fill:' || printf('%07d', i % {names}), 1, '', 'bench-holder', '', '' "
              "FROM s",
}


def fill_events(db_alias: str, count: int, names: int) -> None:
    """Make the audit history of ``db_alias`` hold ``count`` events (kept between runs)."""
    from django.db import connections

    from distlock.db import db_now_us

    connection = connections[db_alias]
    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM distlock_lockevent")
        if cursor.fetchone()[0] == count:
            return
        print(f"  … {db_alias}: filling {count:,} audit events", flush=True)
        cursor.execute("DELETE FROM distlock_lockevent")
        if count == 0:  # --events 0: no history (and no step to spread it by)
            return
        step = 30 * 86400 * 10**6 // count
        cursor.execute(_EVENTS[connection.vendor].format(
            now=db_now_us(db_alias), step=step, count=count, names=names))
        if connection.vendor == "postgresql":
            cursor.execute("VACUUM ANALYZE distlock_lockevent")
        elif connection.vendor == "mysql":
            cursor.execute("ANALYZE TABLE distlock_lockevent")
            cursor.fetchall()


def time_pages(db_alias: str, repeat: int,
               only: Iterable[str] | None = None) -> dict[str, float]:
    """Median milliseconds of each page (of those labelled ``only``), with the lock table
    on ``db_alias``."""
    from django.contrib.auth.models import User
    from django.test import Client, override_settings

    user = User.objects.filter(username="bench").first() or User.objects.create_superuser(
        "bench", "bench@example.com", "bench")
    client = Client()
    client.force_login(user)
    got = {}
    with override_settings(DISTLOCK_DATABASE=db_alias):
        for label, url in pages().items():
            if only is not None and label not in only:
                continue
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
