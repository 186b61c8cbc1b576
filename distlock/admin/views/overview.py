"""The admin's live overview page (/admin/distlock/lock/overview/): a summary row of
counts (held, expired with the holder probably gone, sessions waiting, stale writes
refused today, leases lost or locks broken today), each linking to the list it counts;
then who holds what, which leases ran out, who waits, what is most contended and which
stale writes were refused.

The page loads once; a small script of ours (``distlock/overview.js``, no CDN, no
library) fetches ``overview/fragment/`` every few seconds and swaps it in, so the page
refreshes without a reload. A response without the ``X-Distlock-Fragment`` header (the
login page the fetch was redirected to after a sign-out elsewhere) is never swapped in:
the page says "Signed out — reload to sign in". Both need the Locks list's view
permission. The queries are in :mod:`distlock.admin.overview`, where their costs are
explained. Every time shown is the database clock's, in the site's time zone with the
zone written beside it; the script shows no time of the browser's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.http import urlencode

from distlock.admin.display import (
    clock,
    clock_and_relative,
    cut,
    detail_text,
    precise,
    short_owner,
)
from distlock.admin.overview import (
    EVENT_WINDOW,
    EXPIRED_LIMIT,
    HELD_LIMIT,
    WAITING_LIMIT,
    overview,
)
from distlock.conf import conf
from distlock.core.status import EXPIRED, HELD, duration, relative
from distlock.models import LockEvent

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
# Set on every fragment response: the refresh script swaps in only a response that has
# it, so a login page (a session ended elsewhere) or a proxy's page never fills the panel.
FRAGMENT_HEADER = "X-Distlock-Fragment"
# One waiting session as the PostgreSQL backend names it (see waiting_sessions).
_SESSION = re.compile(r"(.+?) pid (\d+)(?:, |\Z)", re.DOTALL)


def waiting_sessions(who: str) -> list[dict[str, str]]:
    """The waiting sessions of one lock, each as ``{"who": ..., "server_pid": ...}``.

    **Decision: the pid is labelled "server session pid", not mapped.** The PostgreSQL
    backend names each session ``"<application_name, client address or local> pid <n>"``
    (several joined by ", "), and ``n`` is the *server* backend's pid
    (``pg_backend_pid()``, what ``pg_stat_activity`` and ``pg_terminate_backend`` take),
    not the application process's pid that a holder text such as ``"web-1 pid=6745"``
    carries. Nothing maps one to the other: a waiter's registration (``distlock_waiter``,
    the advisory locks) records the lock name and the server pid only, not the holder
    text its acquire will write, so the database cannot name a waiter by its holder
    text. The page names a session by what its connection calls itself (set
    ``application_name`` in the database ``OPTIONS`` to the worker's name) and shows the
    pid under the label it deserves. Naming waiters by holder text would need the
    backend to record it with the registration (``Backend.waiting``; not changed here).
    Text that does not read as such sessions is shown whole, without a pid.
    """
    sessions: list[dict[str, str]] = []
    at = 0
    while at < len(who):
        found = _SESSION.match(who, at)
        if found is None:
            return [*sessions, {"who": who[at:], "server_pid": ""}]
        sessions.append({"who": found[1], "server_pid": found[2]})
        at = found.end()
    return sessions


def _events(events_url: str, kind: str) -> str:
    # The events list has no "since midnight" filter: its last 24 hours contain today.
    return f"{events_url}?{urlencode({'kind': kind, 'age': 'day'})}"


def _context(model_admin: LockAdmin) -> dict[str, Any]:
    """The fragment's data, formatted here so the template stays plain."""
    alias = conf.database()
    data = overview(alias)
    site = model_admin.admin_site.name
    now = data.now_us

    def lock_url(name: str) -> str:
        return reverse(f"{site}:distlock_lock_change", args=[quote(name)])

    locks_url = reverse(f"{site}:distlock_lock_changelist")
    events_url = reverse(f"{site}:distlock_lockevent_changelist")
    waiting: list[dict[str, Any]] | None = None if data.waiting is None else [
        {"name": name, "url": lock_url(name), "sessions": sessions,
         "who": waiting_sessions(who)}
        for name, sessions, who in data.waiting
    ]
    waiting_count = None if data.waiting is None else sum(
        sessions for _, sessions, _ in data.waiting)
    stale_url = _events(events_url, LockEvent.Kind.STALE_WRITE)
    summary = [
        {"key": "held", "label": "held now", "count": data.held_count,
         "url": f"{locks_url}?{urlencode({'state': HELD})}",
         "title": "the Locks list, held ones"},
        {"key": "expired", "label": "expired, holder probably gone",
         "count": data.expired_count,
         "url": f"{locks_url}?{urlencode({'state': EXPIRED})}",
         "title": "the Locks list, expired and not yet taken over"},
        {"key": "waiting", "label": "sessions waiting",
         "count": "?" if waiting_count is None else waiting_count,
         "capped": waiting is not None and len(waiting) >= WAITING_LIMIT,
         "url": "#distlock-waiting", "title": "who waits, below"},
        {"key": "stale", "label": "stale writes refused today", "count": data.stale_count,
         "capped": data.stale_capped, "url": stale_url,
         "title": "the Lock events list: stale writes refused, last 24 hours"},
        {"key": "trouble", "label": "lost or broken today",
         "count": data.lost_count + data.broken_count, "capped": data.stale_capped,
         "url": _events(events_url, LockEvent.Kind.LOST),
         "title": "the Lock events list: leases lost, last 24 hours",
         "parts": [
             {"label": f"{data.lost_count} lost",
              "url": _events(events_url, LockEvent.Kind.LOST)},
             {"label": f"{data.broken_count} broken",
              "url": _events(events_url, LockEvent.Kind.BROKEN)},
         ]},
    ]
    return {
        "now": precise(now),
        "now_short": clock(now, now),
        "zone": timezone.get_current_timezone_name(),
        "summary": summary,
        "held_count": data.held_count,
        "held_limit": HELD_LIMIT,
        "held": [
            {
                "name": row.name, "url": lock_url(row.name), "holder": cut(row.holder),
                "owner": short_owner(row.owner), "token": row.token,
                "held_for": duration((now - (row.acquired_us or now)) / 1e6),
                "acquired": precise(row.acquired_us),
                "expires": clock_and_relative(row.expires_us, now),
                "renewals": row.renew_count,
            }
            for row in data.held
        ],
        "expired_count": data.expired_count,
        "expired_limit": EXPIRED_LIMIT,
        "expired": [
            {
                "name": row.name, "url": lock_url(row.name), "holder": cut(row.holder),
                "owner": short_owner(row.owner), "token": row.token,
                "expired": clock_and_relative(row.expires_us, now),
                "renewals": row.renew_count,
            }
            for row in data.expired
        ],
        "waiting": waiting,
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
            {"at": clock_and_relative(event.at_us, now), "name": event.name,
             "url": lock_url(event.name), "token": event.token, "holder": cut(event.holder),
             "detail": cut(detail_text(event.detail, now), "distlock-cut distlock-detail",
                           title=detail_text(event.detail, now, exact=True))}
            for event in data.stale
        ],
        "stale_count": data.stale_count,
        "stale_capped": data.stale_capped,
        "stale_url": stale_url,
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
        response = TemplateResponse(request, FRAGMENT, _context(model_admin))
        response[FRAGMENT_HEADER] = "1"
        return response

    return view
