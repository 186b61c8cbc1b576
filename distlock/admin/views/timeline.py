"""The timeline picture in the admin: on a lock's page, and for several locks on one time
axis (``<admin>/distlock/lock/timeline/?name=a&name=b``).

A URL rather than an admin action: an action would give every viewer of the lock list
an action form, where now a user who may break nothing has none (and a forged break POST
is answered "No action selected.").

Bounded, so a page costs the same with ten million audit events as with ten. For each
lock, through the ``(name, at_us)`` index: its newest :data:`LOCK_EVENTS` events in the
range, and its newest :data:`LOCK_INCIDENTS` incidents (take-overs, breaks, losses, stale
writes) among its newest :data:`SCAN_EVENTS` of the last :data:`WINDOW_SECONDS`; then one
query for the grants those incidents concern (each within
:data:`~distlock.admin.timeline.INCIDENT_REACH_US` before it) and one for the lock rows.
Incidents are read apart because they are rare: an auto-renewing holder writes a renewal
every third of its ttl, and the newest 200 events shared by all locks, as this page read
before, lost a take-over among them. A lock whose events were cut says so in the caption.

The axis shows, by default, the latest incident of the page's locks and the grants it
concerns (:func:`~distlock.admin.timeline.incident_window`), so the story is still drawn
apart ten minutes or a day later; ``?range=`` picks the last 5 minutes, hour or day
instead, and ``?lanes=holder`` draws one lane per holder (the demo report's view).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import SafeString, mark_safe

from distlock.admin.display import clock_and_relative
from distlock.admin.timeline import (
    GRANTS,
    INCIDENT_REACH_US,
    INCIDENTS,
    Current,
    Timeline,
    build,
    incident_window,
)
from distlock.admin.timeline_svg import render
from distlock.conf import conf
from distlock.db import db_now_us
from distlock.models import Lock, LockEvent
from distlock.validation import check_name

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin

    LockAdmin = ModelAdmin[Lock]

#: The most events of one lock one picture reads (its newest in the range): more would
#: not be told apart in 750 pixels, and drawing them costs about 0.04 ms each.
LOCK_EVENTS = 150
#: The most incidents of one lock one picture reads, apart from its other events, and
#: among how many of its newest events they are looked for (the bound of the read: a
#: holder renewing every 0.3 s writes 5,000 events in 25 minutes).
LOCK_INCIDENTS = 50
SCAN_EVENTS = 5_000
#: The oldest event one picture reads, in seconds before now.
WINDOW_SECONDS = 24 * 3600
#: The ranges ``?range=`` offers, in seconds before now; without one (or with
#: ``incident``), the latest incident's window, or the last day when there was none.
RANGES = {"5m": 300, "1h": 3600, "24h": WINDOW_SECONDS}
_RANGE_WORDS = {"incident": "the latest incident", "5m": "last 5 minutes",
                "1h": "last hour", "24h": "last 24 hours"}
#: The most locks on one picture.
MAX_LOCKS = 20
URL_NAME = "distlock_lock_timeline"
_FIELDS = ("id", "at_us", "kind", "name", "token", "holder", "by", "detail")


@dataclass(frozen=True)
class View:
    """What a picture shows: the range (a :data:`RANGES` key or ``incident``) and whether
    its lanes are per holder."""

    range: str = "incident"
    per_holder: bool = False

    @classmethod
    def of(cls, request: HttpRequest) -> View:
        """The view a request asks for; unknown values fall back to the default."""
        chosen = request.GET.get("range", "incident")
        return cls(chosen if chosen in RANGES else "incident",
                   request.GET.get("lanes") == "holder")


def timeline_of(names: Sequence[str], alias: str, view: View = View()) -> Timeline:
    """The timeline of locks ``names`` on database ``alias`` (bounded reads, see above)."""
    now_us = db_now_us(alias)
    oldest = now_us - WINDOW_SECONDS * 1_000_000
    events = LockEvent.objects.using(alias).only(*_FIELDS)
    incidents = [event for name in names for event in _incidents(events, name, oldest)]
    concerned = Q()
    for event in incidents:  # each term an index range of at most INCIDENT_REACH_US
        if event.token is not None:
            concerned |= Q(name=event.name, token__in=(event.token, event.token - 1),
                           at_us__range=(event.at_us - INCIDENT_REACH_US, event.at_us))
    grants = list(events.filter(concerned, kind__in=GRANTS, at_us__gte=oldest) if concerned
                  else ())
    window: tuple[int, int] | None
    if view.range in RANGES:
        start, end = now_us - RANGES[view.range] * 1_000_000, now_us
        window = (start, end)
        notes = [_RANGE_WORDS[view.range]]
    else:
        window = incident_window([*incidents, *grants], now_us)
        start, end = window if window is not None else (oldest, now_us)
        latest = max((event.at_us for event in incidents), default=now_us)
        notes = ([format_html("around the latest incident, {}",
                              clock_and_relative(latest, now_us, inline=True))]
                 if window is not None else ["the last 24 hours (no incident in them)"])
    seen = {event.id: event for event in [*incidents, *grants]}
    for name in names:
        newest = list(events.filter(name=name, at_us__gte=start, at_us__lte=end)
                      .order_by("-at_us", "-id")[: LOCK_EVENTS + 1])
        if len(newest) > LOCK_EVENTS:
            newest = newest[:LOCK_EVENTS]
            notes.append(f"{name}: its newest {LOCK_EVENTS} events, incidents before them kept")
        seen.update((event.id, event) for event in newest)
    current = {
        row.name: Current(row.token, row.owner, row.holder, row.expires_us)
        for row in Lock.objects.using(alias).filter(name__in=names)
    }
    return build(
        seen.values(), now_us=now_us, current=current, names=[] if view.per_holder else names,
        lane_of=(lambda bar: bar.holder or "unknown holder") if view.per_holder else None,
        notes=notes, window=window,
    )


def _incidents(events: QuerySet[LockEvent], name: str, oldest: int) -> list[LockEvent]:
    """The newest incidents of lock ``name`` among its newest :data:`SCAN_EVENTS` events
    since ``oldest``: the kind is not in the index, so without that bound a lock with a
    million renewals and no incident would be read whole (first the bound's time, read
    from the ``(name, at_us)`` index alone, then the incidents after it)."""
    of_lock = events.filter(name=name, at_us__gte=oldest)
    bound = list(of_lock.order_by("-at_us").values_list("at_us", flat=True)
                 [SCAN_EVENTS - 1:SCAN_EVENTS])
    return list(of_lock.filter(kind__in=INCIDENTS, at_us__gte=bound[0] if bound else oldest)
                .order_by("-at_us", "-id")[:LOCK_INCIDENTS])


def picture(names: Sequence[str], alias: str, label: str = "", view: View = View(),
            page_url: str = "") -> SafeString:
    """The SVG of :func:`timeline_of` in the current time zone, what it covers, and links
    to the other ranges and lanes (to ``page_url``, the several-locks page, when given)."""
    timeline = timeline_of(names, alias, view)
    svg = render(timeline, tz=timezone.get_current_timezone(), label=label)
    # Each note is escaped here, but for the times (markup of display.clock).
    shown = format_html_join("; ", "{}", ((note,) for note in timeline.notes))
    audit = "" if conf.AUDIT else " Audit is off (DISTLOCK_AUDIT): nothing new is recorded."
    # render() escapes every name and text it draws.
    return format_html(
        '<div class="distlock-timeline-box" style="overflow-x:auto">{}</div>'
        '<p class="help distlock-timeline-shown">Audit history of {} (database clock).{}</p>'
        "{}",
        mark_safe(svg), shown, audit, _choices(names, view, page_url),
    )


def _choices(names: Sequence[str], view: View, page_url: str) -> SafeString:
    """The range and lane links to ``page_url``: the chosen range in bold."""
    if not page_url:
        return mark_safe("")
    items = [
        format_html("<strong>{}</strong>", words) if key == view.range
        else format_html('<a href="{}">{}</a>', _url(page_url, names, key, view.per_holder),
                         words)
        for key, words in _RANGE_WORDS.items()
    ]
    other = "one lane per lock" if view.per_holder else "one lane per holder"
    items.append(format_html(
        '<a href="{}">{}</a>', _url(page_url, names, view.range, not view.per_holder), other))
    return format_html('<p class="distlock-timeline-ranges">Show: {}</p>',
                       format_html_join(" · ", "{}", ((item,) for item in items)))


def _url(page_url: str, names: Sequence[str], range_key: str, per_holder: bool) -> str:
    query = [("name", name) for name in names]
    if range_key != "incident":
        query.append(("range", range_key))
    if per_holder:
        query.append(("lanes", "holder"))
    return page_url + "?" + urlencode(query)


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
            page = reverse(f"{model_admin.admin_site.name}:{URL_NAME}")
            context["picture"] = picture(names, conf.database(), view=View.of(request),
                                         page_url=page)
        request.current_app = model_admin.admin_site.name
        response = TemplateResponse(request, "admin/distlock/lock/timeline.html", context)
        if problem:
            response.status_code = 400
        return response

    return timeline_view
