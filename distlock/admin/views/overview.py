"""The admin's live overview page (/admin/distlock/lock/overview/): who holds what, who
waits, what is most contended and which stale writes were refused.

The page loads once; a small script of ours (``distlock/overview.js``, no CDN, no
library) fetches ``overview/fragment/`` every few seconds and swaps it in, so the page
refreshes without a reload. Both need the Locks list's view permission. The queries are
in :mod:`distlock.admin.overview`, where their costs are explained.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.http import urlencode

from distlock.admin.display import cut, precise, short_owner, when, when_and_relative
from distlock.admin.overview import EVENT_WINDOW, HELD_LIMIT, overview
from distlock.conf import conf
from distlock.core.status import duration, relative

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin

    from distlock.models import Lock

    LockAdmin = ModelAdmin[Lock]

View = Callable[[HttpRequest], HttpResponse]
# Seconds between refreshes: often enough to watch a lock change hands, rarely enough
# that an open page costs the database little (each refresh scans the lock table once).
REFRESH_SECONDS = 5
REFRESH_RANGE = range(1, 61)
FRAGMENT = "admin/distlock/lock/overview_fragment.html"


def _context(model_admin: LockAdmin) -> dict[str, Any]:
    """The fragment's data, formatted here so the template stays plain."""
    alias = conf.database()
    data = overview(alias)
    site = model_admin.admin_site.name
    now = data.now_us

    def lock_url(name: str) -> str:
        return reverse(f"{site}:distlock_lock_change", args=[quote(name)])

    events_url = reverse(f"{site}:distlock_lockevent_changelist")
    return {
        "now": precise(now),
        "held_count": data.held_count,
        "held_limit": HELD_LIMIT,
        "held": [
            {
                "name": row.name, "url": lock_url(row.name), "holder": cut(row.holder),
                "owner": short_owner(row.owner), "token": row.token,
                "held_for": duration((now - (row.acquired_us or now)) / 1e6),
                "acquired": when(row.acquired_us),
                "expires": when_and_relative(row.expires_us, now),
                "renewals": row.renew_count,
            }
            for row in data.held
        ],
        "waiting": None if data.waiting is None else [
            {"name": name, "url": lock_url(name), "sessions": sessions, "who": cut(who)}
            for name, sessions, who in data.waiting
        ],
        "waiting_note": data.waiting_note,
        "contended": [
            {
                "name": item.name, "url": lock_url(item.name), "grants": item.grants,
                "holders": item.holders, "took_over": item.took_over,
                "last": relative(item.last_us, now),
                "events_url": f"{events_url}?{urlencode({'name__exact': item.name})}",
            }
            for item in data.contended
        ],
        "contended_capped": data.contended_capped,
        "stale": [
            {"at": when_and_relative(event.at_us, now), "name": event.name,
             "url": lock_url(event.name), "token": event.token, "holder": cut(event.holder),
             "detail": cut(event.detail, "distlock-cut distlock-detail")}
            for event in data.stale
        ],
        "stale_count": data.stale_count,
        "stale_capped": data.stale_capped,
        "stale_url": f"{events_url}?{urlencode({'kind': 'stale_write', 'age': 'day'})}",
        "event_window": f"{EVENT_WINDOW:,}",
        "audit_on": data.audit_on,
    }


def _allowed(model_admin: LockAdmin, request: HttpRequest) -> None:
    # The Locks list's permission: whoever may see the locks may see this summary.
    if not model_admin.has_view_permission(request):
        raise PermissionDenied


def _refresh_seconds(request: HttpRequest) -> int:
    """``?refresh=N`` (1 to 60 seconds) for a closer or a calmer watch; else the default."""
    raw = request.GET.get("refresh", "")
    seconds = int(raw) if raw.isdigit() and len(raw) <= 2 else REFRESH_SECONDS
    return seconds if seconds in REFRESH_RANGE else REFRESH_SECONDS


def page(model_admin: LockAdmin) -> View:
    """The whole page: the admin's frame, the fragment, and the refresh script."""

    def view(request: HttpRequest) -> HttpResponse:
        _allowed(model_admin, request)
        opts = model_admin.opts
        context = {
            **model_admin.admin_site.each_context(request),
            **_context(model_admin),
            "title": "Locks overview",
            "subtitle": None,
            "opts": opts,
            "app_label": opts.app_label,
            "fragment_url": reverse(
                f"{model_admin.admin_site.name}:distlock_overview_fragment"
            ),
            "refresh_seconds": _refresh_seconds(request),
        }
        request.current_app = model_admin.admin_site.name
        return TemplateResponse(request, "admin/distlock/lock/overview.html", context)

    return view


def fragment(model_admin: LockAdmin) -> View:
    """Only the page's changing part, fetched by the refresh script."""

    def view(request: HttpRequest) -> HttpResponse:
        _allowed(model_admin, request)
        # admin_view() marks it never_cache: a refresh always reaches the server.
        return TemplateResponse(request, FRAGMENT, _context(model_admin))

    return view
