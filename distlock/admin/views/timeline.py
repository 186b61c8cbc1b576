"""The timeline picture in the admin: on a lock's page, and for several locks on one time
axis (``<admin>/distlock/lock/timeline/?name=a&name=b``).

A URL rather than an admin action: an action would give every viewer of the lock list
an action form, where now a user who may break nothing has none (and a forged break POST
is answered "No action selected.").

Bounded, so a page costs the same with ten million audit events as with ten: one query
reads at most :data:`WINDOW_EVENTS` events of the chosen locks, newest first, and none
older than :data:`WINDOW_SECONDS` (by the database clock), through the ``name`` and
``at_us`` indexes; one more reads their lock rows. Events older than that window are in
the Lock events list.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString, mark_safe

from distlock.admin.timeline import Current, Timeline, build
from distlock.admin.timeline_svg import render
from distlock.conf import conf
from distlock.db import db_now_us
from distlock.models import Lock, LockEvent
from distlock.validation import check_name

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin

    LockAdmin = ModelAdmin[Lock]

#: The most events one picture reads (the newest ones): more would not be told apart
#: in 750 pixels, and drawing them costs about 0.04 ms each.
WINDOW_EVENTS = 200
#: The oldest event one picture reads, in seconds before now.
WINDOW_SECONDS = 24 * 3600
#: The most locks on one picture.
MAX_LOCKS = 20
URL_NAME = "distlock_lock_timeline"


def timeline_of(names: Sequence[str], alias: str) -> Timeline:
    """The timeline of locks ``names`` on database ``alias`` (the bounded window)."""
    now_us = db_now_us(alias)
    cutoff = now_us - WINDOW_SECONDS * 1_000_000
    events = list(
        LockEvent.objects.using(alias)
        .filter(name__in=names, at_us__gte=cutoff)
        .order_by("-at_us", "-id")
        .only("id", "at_us", "kind", "name", "token", "holder", "by", "detail")[
            : WINDOW_EVENTS + 1
        ]
    )
    notes = []
    if len(events) > WINDOW_EVENTS:
        events = events[:WINDOW_EVENTS]
        notes.append(f"the newest {WINDOW_EVENTS} events")
    else:
        notes.append(f"the last {WINDOW_SECONDS // 3600} hours")
    current = {
        row.name: Current(row.token, row.owner, row.holder, row.expires_us)
        for row in Lock.objects.using(alias).filter(name__in=names)
    }
    return build(events, now_us=now_us, current=current, names=names, notes=notes)


def picture(names: Sequence[str], alias: str, label: str = "") -> SafeString:
    """The SVG of :func:`timeline_of`, in the current time zone, with what it covers."""
    timeline = timeline_of(names, alias)
    svg = render(timeline, tz=timezone.get_current_timezone(), label=label)
    shown = "; ".join(timeline.notes)
    audit = "" if conf.AUDIT else " Audit is off (DISTLOCK_AUDIT): nothing new is recorded."
    # render() escapes every name and text it draws.
    return format_html(
        '<div class="distlock-timeline-box" style="overflow-x:auto">{}</div>'
        '<p class="help">Audit history of {} (database clock).{}</p>',
        mark_safe(svg), shown, audit,
    )


def timeline_url(model_admin: LockAdmin) -> URLPattern:
    """The URL of the several-locks picture, for ``LockAdmin.get_urls``."""
    view = model_admin.admin_site.admin_view(_view(model_admin))
    return path("timeline/", view, name=URL_NAME)


def _view(model_admin: LockAdmin) -> Callable[[HttpRequest], HttpResponse]:
    def timeline_view(request: HttpRequest) -> HttpResponse:
        if not model_admin.has_view_permission(request):
            raise PermissionDenied
        raw = request.GET.getlist("name")
        names: list[str] = []
        problem = ""
        try:
            for name in raw:
                if check_name(name) not in names:
                    names.append(name)
        except (TypeError, ValueError) as exc:
            problem = f"Not a lock name: {exc}"
        if not problem and not names:
            problem = "Name at least one lock: ?name=a&name=b."
        if len(names) > MAX_LOCKS:
            problem = f"At most {MAX_LOCKS} locks on one timeline, not {len(names)}."
        context: dict[str, Any] = {
            **model_admin.admin_site.each_context(request),
            "title": "Timeline" if problem else f"Timeline of {', '.join(names)}",
            "subtitle": None,
            "opts": model_admin.opts,
            "app_label": model_admin.opts.app_label,
            "problem": problem,
            "links": [
                (name, reverse(f"{model_admin.admin_site.name}:distlock_lock_change",
                               args=[quote(name)]))
                for name in names
            ],
        }
        if not problem:
            context["picture"] = picture(names, conf.database())
        request.current_app = model_admin.admin_site.name
        response = TemplateResponse(request, "admin/distlock/lock/timeline.html", context)
        if problem:
            response.status_code = 400
        return response

    return timeline_view
