"""Lock data as HTML for people: badges, times, truncated text, and how a free lock was
freed. Shared by the admin's lists and pages and the overview page.

The lists must fit a 1366 px screen beside Django's navigation and filter sidebars, so
cells are short: a time of today is shown as its time of day, long text is cut with the
whole of it in the ``title`` (hover) and on the object's own page, and relative times
come from :func:`distlock.core.status.relative`, the one place durations become words.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.db.models import Q
from django.utils import dateformat, timezone
from django.utils.html import escape, format_html
from django.utils.safestring import SafeString

from distlock.conf import conf
from distlock.core.status import EXPIRED, FREE, HELD, relative
from distlock.models import Lock, LockEvent
from distlock.times import from_us, to_us

_BADGE_COLOURS = {
    HELD: "#1f7a1f",
    EXPIRED: "#b35900",
    FREE: "#666666",
    LockEvent.Kind.BROKEN: "#b30000",
    LockEvent.Kind.STALE_WRITE: "#b30000",
    LockEvent.Kind.LOST: "#b35900",
    LockEvent.Kind.TOOK_OVER: "#b35900",
}


def badge(value: str, label: str | None = None) -> SafeString:
    """A coloured pill; white on a dark colour reads in the light and the dark theme."""
    colour = _BADGE_COLOURS.get(value, "#205080")
    return format_html(
        '<span class="distlock-badge distlock-{}" style="background:{}">{}</span>',
        value, colour, label or value,
    )


def _local(us: int) -> datetime:
    """The current time zone's time (TIME_ZONE, or the zone a site activated)."""
    return timezone.localtime(from_us(us))


def precise(us: int | None) -> str:
    """The full time with milliseconds and the time zone, for a lock's or event's page
    (leases of a second or less must be told apart there)."""
    if us is None:
        return ""
    local = _local(us)
    return f"{local:%Y-%m-%d %H:%M:%S}.{local.microsecond // 1000:03d} {local:%Z}".rstrip()


def clock_text(us: int, now_us: int, *, exact: bool = False) -> str:
    """:func:`clock`'s text without its markup ("17:37:49 IST"), for a ``title`` (a
    tooltip holds no markup) and a cell cut to its text."""
    if exact:
        return precise(us)
    local = _local(us)
    today = timezone.localtime(from_us(now_us)).date()
    return str(dateformat.format(local, "H:i:s T" if local.date() == today else "Y-m-d H:i:s T"))


def clock(us: int | None, now_us: int, *, exact: bool = False) -> SafeString:
    """A database-clock time in the site's time zone with the zone shown: "17:37:49 IST",
    with the date before it when it is not the database clock's today there; to the
    millisecond on hover. ``exact``: the date and the milliseconds always (a lock's page,
    where leases of a second or less must be told apart).

    The one way the admin shows a time: the database clock, never the browser's or this
    server's, always with its zone."""
    if us is None:
        return SafeString("")
    return format_html('<time class="distlock-when" datetime="{}" title="{}">{}</time>',
                       _local(us).isoformat(), precise(us), clock_text(us, now_us, exact=exact))


def clock_and_relative(
    us: int | None, now_us: int, *, inline: bool = False, exact: bool = False
) -> SafeString:
    """:func:`clock` and "in 59 min" / "12 s ago" beside it: under it in a list cell,
    in brackets after it with ``inline`` ("17:37:49 IST (in 4 min)")."""
    if us is None:
        return SafeString("")
    if inline:
        return format_html('{} <span class="distlock-relative-inline">({})</span>',
                           clock(us, now_us, exact=exact), relative(us, now_us))
    return format_html('{}<span class="distlock-relative">{}</span>',
                       clock(us, now_us, exact=exact), relative(us, now_us))


# An ISO 8601 time with its offset, as the audit writes it into a detail
# ("expires 2026-12-03T12:07:49.920824+00:00", distlock.times.expiry_detail).
_ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,6})?(?:[+-]\d\d:\d\d|Z)")


def _detail_parts(detail: str) -> list[str | int]:
    """``detail`` cut into its text and its times (epoch microseconds, in order)."""
    parts: list[str | int] = []
    last = 0
    for found in _ISO_TIME.finditer(detail):
        try:
            moment = datetime.fromisoformat(found.group(0))
        except ValueError:
            continue  # not a time after all ("2026-13-45T…"): left as written
        parts.append(detail[last:found.start()])
        parts.append(to_us(moment))
        last = found.end()
    parts.append(detail[last:])
    return parts


def detail_text(detail: str, now_us: int, *, exact: bool = False) -> str:
    """An audit detail for people: each time in it (stored as UTC ISO with microseconds,
    the record) as :func:`clock_text` shows it, in the site's zone with the zone:
    "expires 17:37:49 IST". Plain text, for a cell cut to its text and for a tooltip."""
    return "".join(
        part if isinstance(part, str) else clock_text(part, now_us, exact=exact)
        for part in _detail_parts(detail or "")
    )


def detail_html(detail: str, now_us: int, *, exact: bool = False) -> SafeString:
    """:func:`detail_text` as HTML, each time a :func:`clock` (an event's page)."""
    return SafeString("".join(
        str(escape(part)) if isinstance(part, str) else clock(part, now_us, exact=exact)
        for part in _detail_parts(detail or "")
    ))


def elide(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, its middle replaced by "…": the start (a
    holder's host) and the longer end (``pid=… thread=… task=…``, which names the
    worker) stay, as ``distlock_list`` shows a holder."""
    if len(text) <= width:
        return text
    head = (width - 1) // 3
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


# About two lines of the holder column (admin.css's and the list template's width).
HOLDER_WIDTH = 36


def holder_text(text: str) -> SafeString:
    """A holder for a list cell: whole on up to two lines, or its middle elided so that
    its end, the part that names the worker, stays; all of it on hover."""
    if not text:
        return SafeString("")
    # distlock-cut too: its hover text and what finds it stay; the list's style makes it
    # two lines wide instead of one cut at 10em.
    return format_html('<span class="distlock-cut distlock-holder" title="{}">{}</span>', text,
                       elide(text, HOLDER_WIDTH))


def cut(text: str, css: str = "distlock-cut", title: str | None = None) -> SafeString:
    """``text`` in a span its CSS class cuts with an ellipsis; all of it (or ``title``)
    on hover."""
    if not text:
        return SafeString("")
    return format_html('<span class="{}" title="{}">{}</span>', css,
                       text if title is None else title, text)


def short_owner(owner: str) -> SafeString:
    """The first 8 hex digits of an owner (enough to tell grants apart on a page)."""
    if not owner:
        return SafeString("")
    return format_html('<code class="distlock-owner" title="{}">{}…</code>', owner, owner[:8])


def mark_freed(rows: Iterable[Any], alias: str) -> None:
    """Set ``freed_by_event`` on each free row: the audit event (``released`` or
    ``broken``) that freed it, or None when the audit does not say.

    The lock row itself cannot tell a release from a break (both clear the owner), so a
    page asks the audit, once for all its rows: events of those names at or after the
    first event of each name and token at or after the row's release time.
    """
    free = {row.name: row for row in rows if row.is_free}
    for row in free.values():
        row.freed_by_event = None
    if not free or not conf.AUDIT:
        # With audit off nothing records a freeing: no query, "freed" it is.
        return
    # Each row's own freeing: an event of its name and token recorded at or after its
    # release time; through the name index, one or two events per row.
    own = Q()
    for row in free.values():
        own |= Q(name=row.name, token=row.token, at_us__gte=row.expires_us or 0)
    events = (
        LockEvent.objects.using(alias)
        .filter(own, kind__in=[LockEvent.Kind.RELEASED, LockEvent.Kind.BROKEN])
        .order_by("at_us", "id")
        .only("name", "kind", "at_us", "by", "token")
    )
    for event in events:
        row = free[event.name]
        if row.freed_by_event is None:
            row.freed_by_event = event


def freed(row: Lock, now_us: int | None) -> SafeString:
    """ "released 5 s ago", "broken 5 s ago by ops (admin)", or "freed 5 s ago" when
    the audit does not say which (audit off, or the event purged)."""
    when_text = relative(row.expires_us, now_us)
    if not when_text:
        return SafeString("")
    event = getattr(row, "freed_by_event", None)
    if event is None:
        return format_html('<span class="distlock-freed">freed {}</span>', when_text)
    if event.kind == LockEvent.Kind.BROKEN:
        return format_html(
            '<span class="distlock-freed distlock-freed-broken" title="broken by {}">'
            "broken {}</span>", event.by or "?", when_text,
        )
    return format_html('<span class="distlock-freed">released {}</span>', when_text)
