"""Lock timelines: the audit history of locks as bars (grants) and marks (events) on one
time axis, for people.

Pure on purpose: events in, dataclasses out, no database and no admin. The admin pages
(:mod:`distlock.admin.views.timeline`) read a bounded window of :class:`~distlock.models.LockEvent`
rows and the demo's report reads its own run's; both draw with
:func:`distlock.admin.timeline_svg.render`.

A grant is a bar from its grant to the end of its lease: its release, its break, or its
expiry when the next holder took over (the expiry comes from the events' ``expires …``
detail, which the audit writes on every grant and renewal). A holder that was still acting
after its lease ended — a refused stale write, a loss it noticed, a late release — gets a
dashed tail up to that moment: the time it *believed* it held the lock. Everything else is
a mark: expired take-overs, renewals, breaks, losses, refused (or, in the demo's unfenced
run, accepted) stale writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from distlock.constants import RARE_KINDS
from distlock.times import expiry_in

#: Event kinds that start a grant (see LockEvent.Kind).
GRANTS = ("acquired", "took_over")
#: The demo's own kind for a stale write that nothing refused (its unfenced run).
STALE_WRITE_ACCEPTED = "stale_write_accepted"
#: Event kinds that tell an incident: a lease ran out under its holder, was broken or
#: lost, or a stale write came (the audit's rare kinds, and the demo's accepted stale
#: write). Rare beside grants and renewals, and what a picture is for.
INCIDENTS = (*RARE_KINDS, STALE_WRITE_ACCEPTED)
#: Incidents at most this far apart are one story (a pause, its take-over, the refused
#: write when the holder wakes).
INCIDENT_GAP_US = 60_000_000
#: How far before an incident its grants' starts are looked for: a stale holder's grant
#: began a lease before (a 5-minute lease at most, or the picture squashes the incident).
INCIDENT_REACH_US = 300_000_000

class Event(Protocol):
    """What the builder reads of an event; a LockEvent row has all of it."""

    @property
    def at_us(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def token(self) -> int | None: ...
    @property
    def holder(self) -> str: ...
    @property
    def detail(self) -> str: ...


@dataclass(frozen=True)
class Current:
    """A lock's row now: who holds it (empty owner: free) and until when."""

    token: int
    owner: str
    holder: str
    expires_us: int | None


@dataclass(frozen=True)
class Bar:
    """One grant. ``end_us`` None: still held (or its end is not known yet).

    ``ended`` says how it ended: "released", "expired", "broken", "held" (still held now)
    or "unknown" (no event says, e.g. the release was before the window or not recorded).
    ``acted_until_us``: the last sign of the holder after its lease ended.
    """

    name: str
    token: int | None
    holder: str
    start_us: int
    end_us: int | None
    ended: str
    took_over: bool = False
    acted_until_us: int | None = None
    expires_us: int | None = None
    lane: str = ""


@dataclass(frozen=True)
class Mark:
    """One event drawn as a symbol: its kind, time, the grant (token) it concerns."""

    name: str
    kind: str
    at_us: int
    token: int | None
    holder: str
    text: str
    lane: str = ""


@dataclass(frozen=True)
class Lane:
    """One row of the picture: a lock (or, in the demo, a worker) and what it shows."""

    key: str
    bars: tuple[Bar, ...]
    marks: tuple[Mark, ...]
    note: str = ""


@dataclass(frozen=True)
class Timeline:
    """Lanes on one time axis from ``start_us`` to ``end_us`` (epoch microseconds, the
    database clock); ``now_us`` is drawn as a line when given."""

    lanes: tuple[Lane, ...]
    start_us: int
    end_us: int
    now_us: int | None = None
    title: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def empty(self) -> bool:
        return not any(lane.bars or lane.marks for lane in self.lanes)


_MARK_TEXT = {
    "took_over": "expired take-over",
    "renewed": "renewed",
    "broken": "broken",
    "lost": "lease lost",
    "stale_write": "stale write refused",
    STALE_WRITE_ACCEPTED: "stale write ACCEPTED",
    "released": "late release",
}


class _Open:
    """A grant being built (mutable), turned into a frozen Bar at the end."""

    def __init__(self, event: Event, took_over: bool, clipped: bool) -> None:
        self.name, self.token, self.holder = event.name, event.token, event.holder
        self.start_us = event.at_us
        self.took_over = took_over
        self.clipped = clipped  # began before the window: start is the first event seen
        self.expires_us = expiry_in(event.detail)
        self.end_us: int | None = None
        self.ended = ""
        self.acted_until_us: int | None = None

    def close(self, at_us: int, ended: str) -> None:
        if self.ended:
            return
        if ended == "expired" and self.expires_us is not None:
            at_us = min(at_us, self.expires_us)
        self.end_us, self.ended = max(at_us, self.start_us), ended

    def acted(self, at_us: int) -> None:
        self.acted_until_us = max(at_us, self.acted_until_us or at_us)

    def bar(self) -> Bar:
        acted = self.acted_until_us
        if acted is not None and self.end_us is not None and acted <= self.end_us:
            acted = None
        return Bar(
            self.name, self.token, self.holder, self.start_us, self.end_us,
            self.ended or "unknown", self.took_over, acted, self.expires_us,
        )


def _grants_of_one_lock(
    events: Sequence[Event], current: Current | None, now_us: int | None
) -> tuple[list[Bar], list[Mark]]:
    grants: dict[int | None, _Open] = {}
    latest: _Open | None = None
    marks: list[Mark] = []
    for event in events:
        kind = event.kind
        grant = grants.get(event.token)
        if kind in GRANTS:
            if latest is not None and latest.token != event.token:
                # The previous grant ended before this one: by expiry if taken over.
                latest.close(event.at_us, "expired" if kind == "took_over" else "unknown")
            grant = grants[event.token] = latest = _Open(event, kind == "took_over", False)
            if kind == "took_over":
                marks.append(_mark(event, "expired take-over"))
            continue
        if grant is None and event.token is not None and kind in ("renewed", "released"):
            # A grant from before the window: drawn from the window's first event.
            grant = grants[event.token] = _Open(event, False, True)
            grant.start_us = events[0].at_us
            if latest is None or (latest.token or 0) < event.token:
                latest = grant
        if kind == "renewed":
            if grant is not None:
                grant.expires_us = expiry_in(event.detail) or grant.expires_us
            marks.append(_mark(event, _MARK_TEXT["renewed"]))
        elif kind == "released":
            if grant is None:
                continue
            if "expired" in event.detail:
                grant.close(event.at_us, "expired")
                grant.acted(event.at_us)
                marks.append(_mark(event, "released after its lease had expired"))
            else:
                grant.close(event.at_us, "released")
        elif kind == "broken":
            if grant is not None:
                grant.close(event.at_us, "broken")
            marks.append(_mark(event, "broken" + (f" by {_by(event)}" if _by(event) else "")))
        else:  # lost, stale_write, stale_write_accepted and kinds unknown to this version
            if grant is not None:
                grant.close(event.at_us, "expired")
                grant.acted(event.at_us)
            marks.append(_mark(event, _MARK_TEXT.get(kind, kind)))
    if latest is not None and not latest.ended:
        if current is not None and current.owner and current.token == latest.token:
            latest.expires_us = current.expires_us
            if _running(current.expires_us, now_us):
                latest.ended = "held"
            else:  # ran out and nobody took it over: the holder is probably gone
                latest.close(current.expires_us or latest.start_us, "expired")
        elif latest.expires_us is not None and now_us is not None and latest.expires_us <= now_us:
            latest.close(latest.expires_us, "expired")
    return [grant.bar() for grant in grants.values()], marks


def _running(expires_us: int | None, now_us: int | None) -> bool:
    """Whether a lease is still running at ``now_us`` (unknown clock or end: yes)."""
    return expires_us is None or now_us is None or expires_us > now_us


def _by(event: Event) -> str:
    return str(getattr(event, "by", "") or "")


def _mark(event: Event, text: str) -> Mark:
    detail = event.detail or ""
    if detail and event.kind not in ("renewed",) and detail not in text:
        text = f"{text}: {detail}"
    return Mark(event.name, event.kind, event.at_us, event.token, event.holder, text)


def build(
    events: Iterable[Event], *, now_us: int | None = None,
    current: dict[str, Current] | None = None, names: Sequence[str] = (),
    lane_of: Callable[[Bar], str] | None = None, title: str = "",
    notes: Sequence[str] = (), window: tuple[int, int] | None = None,
) -> Timeline:
    """The timeline of ``events`` (any order; several locks allowed).

    One lane per lock name by default, in the order of ``names`` and then by name; with
    ``lane_of`` one lane per key it gives each grant (the demo: per worker), ordered by
    first grant, a mark going to the lane of its grant. ``current`` (lock rows by name)
    marks the grant still held and its expiry; ``now_us`` (the database clock) ends the
    axis and is drawn as a line. ``window`` (start, end) fixes the axis: marks outside it
    are left out and bars are cut at its edges, so a chosen range is drawn at full width
    however much history lies around it.
    """
    ordered = sorted(events, key=lambda e: (e.at_us, getattr(e, "id", 0) or 0))
    by_name: dict[str, list[Event]] = {}
    for event in ordered:
        by_name.setdefault(event.name, []).append(event)
    current = current or {}
    bars: list[Bar] = []
    marks: list[Mark] = []
    for name, of_lock in by_name.items():
        got_bars, got_marks = _grants_of_one_lock(of_lock, current.get(name), now_us)
        bars += got_bars
        marks += got_marks
    if window is not None:
        first, last = window
        marks = [mark for mark in marks if first <= mark.at_us <= last]
        bars = [bar for bar in bars if bar.start_us <= last and _reach(bar) >= first]
    keyed = lane_of or (lambda bar: bar.name)
    bars = [replace(bar, lane=keyed(bar)) for bar in bars]
    lane_of_grant = {(bar.name, bar.token): bar.lane for bar in bars}
    marks = [
        replace(mark, lane=lane_of_grant.get((mark.name, mark.token), mark.name))
        for mark in marks
    ]
    keys = [*names] if lane_of is None else []
    items: list[Bar | Mark] = [*bars, *marks]
    for item in sorted(items, key=_start):
        if item.lane not in keys:
            keys.append(item.lane)
    lanes = tuple(
        Lane(
            key,
            tuple(sorted((b for b in bars if b.lane == key),
                         key=lambda b: (b.start_us, b.token or 0))),
            tuple(sorted((m for m in marks if m.lane == key), key=lambda m: m.at_us)),
            _note(current.get(key), now_us) if lane_of is None else "",
        )
        for key in keys
    )
    start, end = window if window is not None else _span(bars, marks, now_us)
    return Timeline(lanes, start, end, now_us, title, tuple(notes))


def _start(item: Bar | Mark) -> int:
    return item.start_us if isinstance(item, Bar) else item.at_us


def _reach(bar: Bar) -> int:
    """The last moment a bar covers (an open one: for ever)."""
    if bar.end_us is None:
        return 2**62
    return max(bar.end_us, bar.acted_until_us or bar.end_us)


def _note(row: Current | None, now_us: int | None = None) -> str:
    if row is None:
        return ""
    if not row.owner:
        return f"free (last token {row.token})"
    if not _running(row.expires_us, now_us):
        return f"expired: {row.holder or row.owner} (token {row.token}), not taken over"
    return f"held by {row.holder or row.owner} (token {row.token})"


def incident_window(events: Iterable[Event], now_us: int | None = None) -> tuple[int, int] | None:
    """The axis around the latest incident of ``events``, or None when there is none.

    The latest incident and those before it no more than :data:`INCIDENT_GAP_US` apart
    are one story; the window starts at the earliest grant that story concerns (the
    stale holder's, and the one a take-over ended: token - 1) if it began no more than
    :data:`INCIDENT_REACH_US` before, and reaches now when now is closer than the story
    is long. Chosen so that ten minutes, or a day, after a pause its take-over and refused
    write are still drawn apart, not piled at the left of a linear axis.
    """
    listed = sorted(events, key=lambda e: e.at_us)
    story = [e for e in listed if e.kind in INCIDENTS]
    if not story:
        return None
    last = first = story[-1].at_us
    for event in reversed(story):
        if first - event.at_us > INCIDENT_GAP_US:
            break
        first = event.at_us
    concerned = {(e.name, e.token) for e in story if e.at_us >= first}
    concerned |= {(e.name, e.token - 1) for e in story
                  if e.at_us >= first and e.kind == "took_over" and e.token is not None}
    starts = [e.at_us for e in listed if e.kind in GRANTS and (e.name, e.token) in concerned
              and first - INCIDENT_REACH_US <= e.at_us <= first]
    start = min([first, *starts])
    span = max(last - start, 1_000_000)
    if now_us is not None and last < now_us <= last + span:
        last = now_us
    pad = max((last - start) // 8, 250_000)
    return start - pad, last + pad


def _span(bars: list[Bar], marks: list[Mark], now_us: int | None) -> tuple[int, int]:
    """The axis: first to last moment shown, the current holder's expiry included when it
    is near (a 1-hour lease would squash a minute of history into a sliver).

    Now is on the axis while a grant is held or the history is recent (no older than it
    is long); otherwise five seconds of grants seen an hour later would be a sliver too.
    """
    moments = [m.at_us for m in marks]
    for bar in bars:
        moments += [bar.start_us, *(t for t in (bar.end_us, bar.acted_until_us) if t)]
    if not moments:
        now = now_us or 0
        return now - 60_000_000, now
    start, end = min(moments), max(moments)
    held = any(bar.ended == "held" for bar in bars)
    if now_us is not None and (held or now_us - end <= max(end - start, 1_000_000)):
        end = max(end, now_us)
    for bar in bars:
        near = max(end - start, 1_000_000) // 3
        if bar.ended == "held" and bar.expires_us is not None and 0 < bar.expires_us - end <= near:
            end = bar.expires_us
    if end - start < 1_000_000:  # at least a second, so single events have room
        end = start + 1_000_000
    pad = (end - start) // 40
    return start - pad, end + pad
