"""The timeline picture: the pure builder and SVG renderer (no database), and the admin's
pages that show it (test client, real database). The browser test with real processes is
tests/test_browser_timeline.py.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
from django.contrib.admin.utils import quote
from django.urls import reverse
from django.utils.http import urlencode

from distlock import StaleToken, acquire
from distlock.admin.timeline import Current, build, incident_window
from distlock.admin.timeline_svg import render
from distlock.admin.views.timeline import LOCK_EVENTS, MAX_LOCKS
from distlock.models import LockEvent
from distlock.testing import take_over
from distlock.times import expiry_detail, expiry_in, from_us
from tests.testapp.models import Account

S = 1_000_000
T0 = 1_790_000_000 * S
SVG = "{http://www.w3.org/2000/svg}"


@dataclass
class Event:
    at_us: int
    kind: str
    name: str
    token: int | None
    holder: str = "host:1"
    detail: str = ""
    by: str = ""


def grant(at_us: int, token: int, ttl_us: int, kind: str = "acquired", name: str = "job",
          holder: str = "host:1") -> Event:
    return Event(at_us, kind, name, token, holder, expiry_detail(from_us(at_us + ttl_us)))


def parse(svg: str) -> ET.Element:
    """The SVG as XML: it must be well-formed whatever the names held."""
    return ET.fromstring(svg)



def test_no_two_labels_of_the_axis_overlap():
    """Over many spans and offsets, with "now" inside the window, past it, or not given,
    no two labels of the axis' row overlap by the renderer's own (wide) estimate of their
    widths: not two ticks — the last, ended at its line near the right edge, reached back
    over its neighbour (a CI run's browser test, at 390 px) — nor a tick and "now"."""
    from itertools import pairwise

    from distlock.admin.timeline import Timeline
    from distlock.admin.timeline_svg import TOP, _text_w

    checked = 0
    for span_ms in range(500, 9000, 37):
        for shift_ms in (0, 13, 49, 91):
            start = T0 + shift_ms * 1000
            end = start + span_ms * 1000
            for now in (None, (start + end) // 2, end + 600 * S):
                root = parse(render(Timeline(lanes=(), start_us=start, end_us=end, now_us=now)))
                spans = []
                for text in root.iter(f"{SVG}text"):
                    if text.get("y") != str(TOP - 10):
                        continue
                    x, width = float(text.get("x", "0")), _text_w("".join(text.itertext()))
                    anchor = text.get("text-anchor", "start")
                    left = x - {"end": width, "middle": width / 2}.get(anchor, 0.0)
                    if text.get("dx"):
                        left += float(text.get("dx", "0"))
                    spans.append((left, left + width, "".join(text.itertext())))
                spans.sort()
                for a, b in pairwise(spans):
                    assert a[1] <= b[0], (span_ms, shift_ms, now, a, b)
                checked += 1
    assert checked > 600

def bars(root: ET.Element) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if "dl-bar " in g.get("class", "") + " "
            and g.get("data-token") is not None]


def marks(root: ET.Element, kind: str) -> list[ET.Element]:
    return [g for g in root.iter(f"{SVG}g") if g.get("data-kind") == kind]


# -- the pure part --------------------------------------------------------------------


def test_expiry_detail_round_trips_to_microseconds():
    moment = datetime(2026, 12, 2, 4, 21, 5, 123456, tzinfo=UTC)
    text = expiry_detail(moment)
    assert expiry_in(f"took over the expired lease of x; {text}") == T0_of(moment)
    assert expiry_in("") is None and expiry_in("expires soon") is None


def T0_of(moment: datetime) -> int:  # noqa: N802 - reads as the constant it computes
    return int(moment.timestamp()) * S + moment.microsecond


def test_the_seeds_story_paused_holder_ends_at_expiry_next_token_then_refused_write():
    events = [
        grant(T0, 7, 1 * S, holder="host:1 paused"),
        grant(T0 + 1_200_000, 8, 1 * S, kind="took_over", holder="host:2 next"),
        Event(T0 + 1_500_000, "stale_write", "job", 7, "host:1 paused",
              "testapp.Account: write with token 7 refused (row token 8)"),
        Event(T0 + 1_600_000, "released", "job", 8, "host:2 next"),
    ]
    timeline = build(reversed(events), now_us=T0 + 2 * S)  # any order in
    (lane,) = timeline.lanes
    first, second = lane.bars
    assert (first.token, first.end_us, first.ended) == (7, T0 + S, "expired")
    assert first.acted_until_us == T0 + 1_500_000  # the paused holder still acted
    assert (second.token, second.start_us, second.end_us, second.ended) == (
        8, T0 + 1_200_000, T0 + 1_600_000, "released")
    assert second.took_over
    assert [(m.kind, m.token) for m in lane.marks] == [("took_over", 8), ("stale_write", 7)]
    root = parse(render(timeline))
    drawn = bars(root)
    assert [b.get("data-token") for b in drawn] == ["7", "8"]
    x = [float(b.find(f"{SVG}rect").get("x")) for b in drawn]
    assert x[0] < x[1]
    (stale,) = marks(root, "stale_write")
    assert float(stale.find(f"{SVG}circle").get("cx")) > x[1]
    assert "token 8" in "".join(drawn[1].itertext())


def test_hostile_names_holders_and_details_are_escaped():
    name = '<script>alert("x")</script>'
    holder = "O'Brien \"host\" </title><script>"
    events = [
        Event(T0, "acquired", name, 3, holder, expiry_detail(from_us(T0 + 60 * S))),
        Event(T0 + S, "broken", name, 3, holder, "", by='<img src=x onerror="y">'),
        Event(T0 + 2 * S, "lost", name, 3, holder, "</text><script>bad()</script>"),
    ]
    svg = render(build(events, now_us=T0 + 3 * S, current={name: Current(3, "", "", None)}),
                 label=f"timeline of {name}")
    assert "<script" not in svg and "<img" not in svg and "onerror=\"" not in svg
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in svg
    root = parse(svg)
    texts = "".join(root.itertext())
    assert name in texts and holder in texts and '<img src=x onerror="y">' in texts
    (lane,) = root.iterfind(f".//{SVG}g[@data-lane]")
    assert lane.get("data-lane") == name
    assert bars(root)[0].get("data-holder") == holder


def test_empty_history_draws_an_empty_axis_with_a_message():
    timeline = build([], now_us=T0)
    assert timeline.empty and timeline.lanes == ()
    root = parse(render(timeline))
    assert bars(root) == []
    assert "no audit events in this window" in "".join(root.itertext())


def test_one_open_grant_is_held_to_its_expiry():
    events = [grant(T0, 1, 10 * S, holder="worker-A")]
    timeline = build(events, now_us=T0 + 2 * S,
                     current={"job": Current(1, "owner1", "worker-A", T0 + 10 * S)})
    ((bar,),) = [lane.bars for lane in timeline.lanes]
    assert (bar.ended, bar.end_us, bar.expires_us) == ("held", None, T0 + 10 * S)
    assert timeline.lanes[0].note == "held by worker-A (token 1)"
    root = parse(render(timeline))
    (drawn,) = bars(root)
    assert drawn.get("data-ended") == "held" and drawn.get("data-end-us") == ""
    assert "held now" in "".join(root.itertext())


def test_a_far_expiry_does_not_squash_the_history_and_is_written_instead():
    events = [grant(T0, 1, 3600 * S)]
    timeline = build(events, now_us=T0 + 5 * S,
                     current={"job": Current(1, "o", "h", T0 + 3600 * S)})
    assert timeline.end_us < T0 + 10 * S
    assert "lease ends" in render(timeline)


def test_a_grant_without_its_release_in_the_window_and_a_renewed_one_before_it():
    events = [
        Event(T0, "renewed", "job", 4, "h", expiry_detail(from_us(T0 + 5 * S))),
        Event(T0 + S, "released", "job", 4, "h"),
        grant(T0 + 2 * S, 5, S),
        Event(T0 + S // 2, "released", "job", 3, "h"),  # granted before the window
    ]
    timeline = build(events, now_us=T0 + 10 * S, current={"job": Current(6, "", "", None)})
    early, first, second = timeline.lanes[0].bars
    assert (early.token, early.start_us, early.end_us) == (3, T0, T0 + S // 2)
    assert (first.token, first.start_us, first.ended) == (4, T0, "released")
    assert (second.token, second.end_us, second.ended) == (5, T0 + 3 * S, "expired")


def test_old_history_is_not_squashed_against_now():
    """Five seconds of grants seen an hour later fill the axis; "now" is written, not
    drawn. While a grant is held, now stays on the axis."""
    events = [grant(T0, 1, S), Event(T0 + S // 2, "released", "job", 1),
              grant(T0 + 4 * S, 2, S), Event(T0 + 5 * S, "released", "job", 2)]
    timeline = build(events, now_us=T0 + 3600 * S)
    assert timeline.end_us < T0 + 6 * S
    assert "now: 59 min later →" in render(timeline)
    held = build(events[:3], now_us=T0 + 3600 * S,
                 current={"job": Current(2, "o", "h", T0 + 7200 * S)})
    assert held.end_us >= T0 + 3600 * S


def test_lanes_per_worker_put_each_mark_with_its_grant():
    events = [
        grant(T0, 1, S, holder="a"), grant(T0 + 2 * S, 2, S, "took_over", holder="b"),
        Event(T0 + 3 * S, "stale_write_accepted", "job", 1, "a"),
    ]
    workers = {1: "worker a", 2: "worker b"}
    timeline = build(events, lane_of=lambda bar: workers[bar.token or 0])
    assert [lane.key for lane in timeline.lanes] == ["worker a", "worker b"]
    assert [m.kind for m in timeline.lanes[0].marks] == ["stale_write_accepted"]
    assert "stale write ACCEPTED" in render(timeline)


def test_a_lease_that_ran_out_unclaimed_is_drawn_expired_not_held():
    """The row still names its owner (nobody took over), but its lease ended: expired."""
    events = [grant(T0, 3, 2 * S, holder="gone")]
    row = {"job": Current(3, "owner3", "gone", T0 + 2 * S)}
    ((bar,),) = [lane.bars for lane in build(events, now_us=T0 + 5 * S, current=row).lanes]
    assert (bar.ended, bar.end_us) == ("expired", T0 + 2 * S)
    timeline = build(events, now_us=T0 + 5 * S, current=row)
    assert timeline.lanes[0].note == "expired: gone (token 3), not taken over"
    assert [b.get("data-ended") for b in bars(parse(render(timeline)))] == ["expired"]
    # One microsecond before its end it is held.
    held = build(events, now_us=T0 + 2 * S - 1, current=row)
    assert held.lanes[0].bars[0].ended == "held"


def story(at_us: int, renewing_until_us: int = 0) -> list[Event]:
    """The seed's story at ``at_us`` (a 1 s lease taken over at its end, a refused write),
    and the new holder renewing every 0.3 s until ``renewing_until_us``."""
    events = [
        grant(at_us, 7, 1 * S, holder="host:1 paused"),
        grant(at_us + 1_000_100, 8, 1 * S, kind="took_over", holder="host:2 next"),
        Event(at_us + 1_500_000, "stale_write", "job", 7, "host:1 paused", "refused"),
    ]
    at = at_us + 1_300_000
    while at < renewing_until_us:
        events.append(Event(at, "renewed", "job", 8, "host:2 next",
                            expiry_detail(from_us(at + S))))
        at += 300_000
    return events


def test_the_incident_window_keeps_the_story_apart_ten_minutes_later():
    now = T0 + 600 * S
    events = story(T0, renewing_until_us=now)
    window = incident_window(events, now)
    assert window is not None
    start, end = window
    assert start < T0 < T0 + 1_500_000 < end < T0 + 3 * S  # the stale grant to the write
    timeline = build(events, now_us=now, window=window,
                     current={"job": Current(8, "o", "host:2 next", now + S)})
    root = parse(render(timeline))
    (took,) = marks(root, "took_over")
    (stale,) = marks(root, "stale_write")
    x_took = float(took.find(f"{SVG}path").get("d").split()[0][1:])
    x_stale = float(stale.find(f"{SVG}circle").get("cx"))
    assert x_stale - x_took >= 20 * 4  # 0.5 s of a ~2 s axis: a quarter of 750 px
    assert len(marks(root, "renewed")) < 10  # only those inside the window
    # Without the window, ten minutes of renewals squash the story into a few pixels.
    squashed = parse(render(build(events, now_us=now,
                                  current={"job": Current(8, "o", "h", now + S)})))
    (took,) = marks(squashed, "took_over")
    (stale,) = marks(squashed, "stale_write")
    assert (float(stale.find(f"{SVG}circle").get("cx"))
            - float(took.find(f"{SVG}path").get("d").split()[0][1:])) < 20


def test_the_incident_window_joins_incidents_a_minute_apart_and_reaches_now_when_near():
    events = [*story(T0), Event(T0 + 50 * S, "broken", "job", 8, "host:2 next")]
    start, end = incident_window(events, T0 + 51 * S) or (0, 0)
    assert start < T0 and end >= T0 + 51 * S  # both incidents, and now (1 s after)
    later = [*events, Event(T0 + 200 * S, "lost", "job", 9, "h")]
    start, end = incident_window(later, T0 + 1000 * S) or (0, 0)
    assert T0 + 190 * S < start < T0 + 200 * S < end < T0 + 210 * S  # the last one only
    assert incident_window([grant(T0, 1, S)], T0 + S) is None
    # A take-over alone: the grant it ended (token - 1) is part of the story.
    taken = [grant(T0, 7, 2 * S), grant(T0 + 2 * S, 8, S, kind="took_over")]
    start, _ = incident_window(taken, T0 + 1000 * S) or (0, 0)
    assert start < T0


def test_a_window_leaves_out_marks_outside_it_and_cuts_bars_at_its_edges():
    events = story(T0, renewing_until_us=T0 + 20 * S)
    timeline = build(events, now_us=T0 + 20 * S, window=(T0 + 5 * S, T0 + 10 * S))
    (lane,) = timeline.lanes
    assert all(T0 + 5 * S <= mark.at_us <= T0 + 10 * S for mark in lane.marks)
    assert [bar.token for bar in lane.bars] == [8]  # token 7 ended before the window
    assert (timeline.start_us, timeline.end_us) == (T0 + 5 * S, T0 + 10 * S)
    drawn = bars(parse(render(timeline)))
    assert float(drawn[0].find(f"{SVG}rect").get("x")) == 210  # cut at the axis' start


def test_tooltips_carry_the_zone_and_no_raw_iso_time(settings):
    from zoneinfo import ZoneInfo

    settings.TIME_ZONE = "Asia/Kolkata"
    events = [grant(T0, 7, S), grant(T0 + S, 8, S, kind="took_over")]
    svg = render(build(events, now_us=T0 + 2 * S), tz=ZoneInfo("Asia/Kolkata"))
    titles = [t.text or "" for t in parse(svg).iter(f"{SVG}title")]
    tips = [t for t in titles if "granted" in t or "take-over" in t]
    assert len(tips) >= 3 and all(" IST" in tip for tip in tips), tips
    assert not re.search(r"\d{4}-\d\d-\d\dT\d", svg), "a raw ISO time in the picture"


# -- the admin pages ------------------------------------------------------------------


@pytest.fixture
def ops(client, django_user_model, settings, lock_db):
    settings.DISTLOCK_AUDIT = True
    client.force_login(django_user_model.objects.create_superuser("ops", "o@x.org", "pw"))
    return client


def test_a_locks_page_shows_its_picture_with_the_story(ops):
    account = Account.objects.create(balance=1)
    old = acquire(f"account:{account.pk}", ttl=30, holder="paused")
    new = take_over(old, ttl=30, holder="next")
    account.balance = 2
    with pytest.raises(StaleToken):
        account.save(fence=old)
    page = ops.get(reverse("admin:distlock_lock_change", args=[quote(old.name)]))
    html = page.content.decode()
    assert page.status_code == 200 and 'id="distlock-timeline"' in html
    tokens = re.findall(r'class="dl-bar dl-bar-(\w+)" data-token="(\d+)"', html)
    assert tokens == [("expired", str(old.token)), ("held", str(new.token))]
    assert 'data-kind="took_over"' in html and 'data-kind="stale_write"' in html
    assert "held by" in html and "next" in html


def test_several_locks_on_one_axis(ops):
    for name in ("a", "b"):
        acquire(name, ttl=30).release()
    url = reverse("admin:distlock_lock_timeline")
    page = ops.get(url, {"name": ["a", "b"]})
    assert page.status_code == 200
    html = page.content.decode()
    assert re.findall(r'data-lane="(\w)"', html) == ["a", "b"]
    assert len(re.findall(r'<svg[^>]* class="distlock-timeline"', html)) == 1


def test_a_hostile_lock_name_is_escaped_on_the_pages(ops):
    name = '<script>alert("x")</script>'
    acquire(name, ttl=30, holder="<b>h'</b>").release()
    for url in (reverse("admin:distlock_lock_change", args=[quote(name)]),
                reverse("admin:distlock_lock_timeline") + "?" + urlencode({"name": name})):
        html = ops.get(url, follow=True).content.decode()
        assert 'data-lane="&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"' in html
        assert "<script>alert" not in html and "<b>h'" not in html


@pytest.mark.parametrize(
    ("names", "message"),
    [([], "Name at least one lock"), (["x" * 300], "Not a lock name"),
     ([f"n{i}" for i in range(MAX_LOCKS + 1)], f"At most {MAX_LOCKS} locks")],
)
def test_the_timeline_page_refuses_bad_names(ops, names, message):
    page = ops.get(reverse("admin:distlock_lock_timeline"), {"name": names})
    assert page.status_code == 400 and message in page.content.decode()
    assert "distlock-timeline\"" not in page.content.decode()


def test_the_timeline_page_needs_the_view_permission(client, django_user_model, lock_db):
    user = django_user_model.objects.create_user("nobody", password="pw", is_staff=True)
    client.force_login(user)
    page = client.get(reverse("admin:distlock_lock_timeline"), {"name": "a"})
    assert page.status_code == 403


def test_the_picture_reads_a_bounded_window(ops, django_assert_max_num_queries):
    from distlock.db import db_now_us

    now = db_now_us("default")
    LockEvent.objects.bulk_create(
        LockEvent(at_us=now - (LOCK_EVENTS + 50 - i) * 1000, kind="acquired", name="busy",
                  token=i) for i in range(LOCK_EVENTS + 50)
    )
    with django_assert_max_num_queries(8):
        page = ops.get(reverse("admin:distlock_lock_timeline"), {"name": "busy"})
    html = page.content.decode()
    assert f"busy: its newest {LOCK_EVENTS} events" in html
    tokens = [int(t) for t in re.findall(r'class="dl-bar [^"]*" data-token="(\d+)"', html)]
    assert len(tokens) == LOCK_EVENTS and min(tokens) == 50


def test_an_incident_outlives_the_renewals_of_its_own_and_other_locks(ops):
    """A real take-over and refused write, then more renewals than a picture reads, on
    this lock and on two others: the incident is drawn, the caption says what was cut."""
    from distlock.db import db_now_us

    account = Account.objects.create(balance=1)
    old = acquire(f"account:{account.pk}", ttl=30, holder="paused")
    new = take_over(old, ttl=30, holder="next")
    account.balance = 2
    with pytest.raises(StaleToken):
        account.save(fence=old)
    now = db_now_us("default")
    LockEvent.objects.bulk_create(
        LockEvent(at_us=now + i * 1000, kind="renewed", name=name, token=token, holder="r",
                  detail=expiry_detail(from_us(now + i * 1000 + 30 * S)))
        for name, token in ((new.name, new.token), ("r1", 1), ("r2", 1))
        for i in range(1, LOCK_EVENTS + 20)
    )
    url = reverse("admin:distlock_lock_timeline")
    html = ops.get(url, {"name": [new.name, "r1", "r2"]}).content.decode()
    assert 'data-kind="took_over"' in html and 'data-kind="stale_write"' in html
    assert "around the latest incident" in html
    assert f"{new.name}: its newest {LOCK_EVENTS} events, incidents before them kept" in html
    assert "<strong>the latest incident</strong>" in html
    assert "range=1h" in html and "lanes=holder" in html
    hour = ops.get(url, {"name": [new.name, "r1", "r2"], "range": "1h"}).content.decode()
    assert "Audit history of last hour" in hour and "<strong>last hour</strong>" in hour
    holders = ops.get(url, {"name": new.name, "lanes": "holder"}).content.decode()
    lanes = re.findall(r'data-lane="([^"]+)"', holders)  # the renewals go with their grant
    assert [lane.rsplit(" ", 1)[-1] for lane in lanes] == ["paused", "next"], lanes
    odd = ops.get(url, {"name": new.name, "range": "<x>", "lanes": "?"})
    assert odd.status_code == 200
    assert "<strong>the latest incident</strong>" in odd.content.decode()


def test_the_lock_page_links_the_ranges_to_the_timeline_page(ops):
    acquire("ranged", ttl=30).release()
    html = ops.get(reverse("admin:distlock_lock_change", args=["ranged"])).content.decode()
    page = reverse("admin:distlock_lock_timeline")
    assert f'href="{page}?name=ranged&amp;range=5m"' in html
    assert "the last 24 hours (no incident in them)" in html
