"""The admin's overview page and its queries (distlock/admin/overview.py) on a real database:
what is held, who waits (PostgreSQL's registrations, played by hand with real sessions),
what is most contended and which stale writes were refused, each within its bounds."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.db.models import F
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from distlock import acquire
from distlock.admin import overview
from distlock.admin.views import overview as overview_views
from distlock.core.status import locks
from distlock.db import db_now_us
from distlock.models import Lock, LockEvent
from distlock.ops.audit import record
from distlock.times import EPOCH, from_us
from tests.support.helpers import expired_lock, wait_until

pytestmark = pytest.mark.usefixtures("lock_db")

PAGE = "admin:distlock_overview"
FRAGMENT = "admin:distlock_overview_fragment"


def staff(django_user_model, name: str, *codenames: str) -> Client:
    user = django_user_model.objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


def test_held_now_counts_all_and_lists_the_longest_held_first(monkeypatch):
    first = acquire("held:first", ttl=60)
    acquire("held:second", ttl=60)
    acquire("held:third", ttl=60)
    expired_lock("held:expired")
    acquire("held:free", ttl=60).release()
    now = db_now_us("default")
    rows, count = overview.held_now("default", now, limit=2)
    assert count == 3
    assert [row.name for row in rows] == ["held:first", "held:second"]
    assert rows[0].token == first.token and rows[0].db_now_us >= rows[0].acquired_us
    assert overview.held_now("default", now)[1] == 3
    first.release()
    assert overview.held_now("default", db_now_us("default"))[1] == 2


def test_nothing_held():
    acquire("gone", ttl=60).release()
    assert overview.held_now("default", db_now_us("default")) == ([], 0)


def test_most_contended_in_the_last_hour_from_the_audit(settings):
    settings.DISTLOCK_AUDIT = True
    for holder in ("a", "b", "c"):
        acquire("busy", ttl=60, holder=holder).release()
    for _ in range(4):
        acquire("solo", ttl=60, holder="same").release()
    for _ in range(5):
        acquire("old", ttl=60, holder="x").release()
    LockEvent.objects.filter(name="old").update(at_us=db_now_us("default") - 2 * 3600 * 10**6)
    data = overview.overview("default")
    got = [(item.name, item.holders, item.grants) for item in data.contended]
    # Most grants first, not most holders (issue 34: a lock granted 510 times to 3
    # workers was absent); "old" is older than the hour.
    assert got == [("solo", 1, 4), ("busy", 3, 3)]
    assert not data.contended_capped


def test_most_contended_counts_take_overs_as_grants_and_ranks_ties_by_them(settings):
    settings.DISTLOCK_AUDIT = True
    for _ in range(2):
        acquire("calm", ttl=60, holder="w").release()
    acquire("stolen", ttl=60, holder="w").release()
    expired_lock("stolen", holder="sleepy")
    acquire("stolen", ttl=60, holder="thief").release()  # a take-over
    got = [(item.name, item.grants, item.took_over)
           for item in overview.overview("default").contended]
    assert got == [("stolen", 3, 1), ("calm", 2, 0)]


@pytest.mark.skipif("connection.vendor != 'sqlite'", reason="SQLite's planner, steered")
def test_most_contended_reads_the_hour_through_at_us_on_sqlite():
    """Grouping by the name, SQLite walked the whole (name, at_us) index (10M events:
    5 s); grouped by ``+name`` it reads the hour through ``at_us``."""
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        overview.most_contended("default", db_now_us("default") - overview.HOUR_US)
    [sql] = [q["sql"] for q in captured.captured_queries if "GROUP BY" in q["sql"]]
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN QUERY PLAN " + sql)
        plan = " ".join(str(row[-1]) for row in cursor.fetchall())
    assert "distlock_event_name_at" not in plan and "(at_us>?)" in plan


def test_stale_writes_refused_today(settings):
    settings.DISTLOCK_AUDIT = True
    lease = acquire("fenced", ttl=60)
    for n in range(3):
        record("stale_write", name="fenced", using="default", token=lease.token,
               detail=f"shop.Account: write {n} refused")
    record("stale_write", name="yesterday", using="default", token=1)
    LockEvent.objects.filter(name="yesterday").update(
        at_us=overview.midnight_us(db_now_us("default")) - 1)
    data = overview.overview("default")
    assert data.stale_count == 3 and not data.stale_capped
    assert [event.detail for event in data.stale] == [
        f"shop.Account: write {n} refused" for n in (2, 1, 0)
    ]


def test_a_busy_period_is_read_from_its_newest_events_only(settings, monkeypatch):
    """The event window bounds every audit query of the page, and the page says so."""
    settings.DISTLOCK_AUDIT = True
    monkeypatch.setattr(overview, "EVENT_WINDOW", 4)
    for n in range(3):
        record("stale_write", name="early", using="default", token=1, detail=str(n))
    for holder in ("a", "b", "c"):
        acquire("late", ttl=60, holder=holder).release()  # 6 events, newer
    data = overview.overview("default")
    assert data.contended_capped and data.stale_capped
    assert data.stale_count == 0  # the 3 refused writes are older than the newest 4 events
    # The newest 4 events: the grants and releases of "b" and "c" only.
    assert [(item.name, item.holders, item.grants) for item in data.contended] == [
        ("late", 2, 2)
    ]


def test_waiting_is_unknown_where_waiters_register_nowhere():
    if connection.vendor == "postgresql":
        pytest.skip("PostgreSQL knows its waiters (the next test)")
    found, note = overview.waiting("default")
    assert found is None
    assert "does not record waiters" in note


@pytest.mark.no_pooler("plays waiters by hand: a session advisory lock and LISTEN")
@pytest.mark.skipif("connection.vendor != 'postgresql'",
                    reason="waiters register (pg_locks) on PostgreSQL only")
def test_waiting_sessions_on_postgresql(admin_client):
    import psycopg

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    holder = acquire("wanted", ttl=60)
    acquire("free-but-waited", ttl=60).release()
    sessions = [psycopg.connect(**params, autocommit=True, application_name=f"waiter-{n}")
                for n in range(3)]
    try:
        for raw, name in zip(sessions, ["wanted", "wanted", "free-but-waited"], strict=True):
            raw.execute("SELECT distlock_listen(%s)", [name])
        found, note = overview.waiting("default")
        assert "registered for a wake-up" in note
        assert len(found) == 1
        name, count, who = found[0]
        assert (name, count) == ("wanted", 2)
        assert re.fullmatch(r"waiter-[01] pid \d+, waiter-[01] pid \d+", who)
        html = admin_client.get(reverse(FRAGMENT)).content.decode()
        pids = sorted(str(raw.info.backend_pid) for raw in sessions[:2])
        assert sorted(re.findall(r"waiter-[01] <span class=\"distlock-quiet\">"
                                 r"server session pid (\d+)</span>", html)) == pids
        assert re.search(r'id="distlock-summary-waiting">.*?distlock-figure">2<', html,
                         re.DOTALL)
        sessions[0].execute("SELECT distlock_unlisten(%s)", ["wanted"])
        assert [row[:2] for row in overview.waiting("default")[0]] == [("wanted", 1)]
    finally:
        for raw in sessions:
            raw.close()
    # A closed session's backend ends a moment after the client has gone.
    wait_until(lambda: overview.waiting("default")[0] == [], 10, "the waiters' sessions end")
    assert holder.release() is True


# --- the page ----------------------------------------------------------------------


def test_page_and_fragment_show_the_overview(django_user_model, settings):
    settings.DISTLOCK_AUDIT = True
    acquire("shown", ttl=600, holder="<b>holder</b>")
    client = staff(django_user_model, "viewer", "view_lock")
    page = client.get(reverse(PAGE))
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-fragment-url="' + reverse(FRAGMENT) + '"' in html
    assert 'data-refresh-seconds="5"' in html and "distlock/overview.js" in html
    assert re.search(r'id="distlock-held-count">1<', html)
    assert "&lt;b&gt;holder&lt;/b&gt;" in html and "<b>holder</b>" not in html
    fragment = client.get(reverse(FRAGMENT))
    assert fragment.status_code == 200 and "no-store" in fragment["Cache-Control"]
    body = fragment.content.decode()
    assert "<html" not in body and 'id="distlock-held-count">1<' in body
    assert re.search(r"in (9|10) min", body)
    assert ">shown</a>" in body


@pytest.mark.parametrize(("value", "seconds"), [
    ("1", 1), ("60", 60), ("0", 5), ("61", 5), ("-1", 5), ("abc", 5), ("9" * 30, 5), ("", 5),
])
def test_refresh_interval_is_bounded(admin_client, value, seconds):
    html = admin_client.get(reverse(PAGE), {"refresh": value}).content.decode()
    assert f'data-refresh-seconds="{seconds}"' in html


def test_same_permission_as_the_locks_list(django_user_model):
    nobody = staff(django_user_model, "nobody")
    assert nobody.get(reverse(PAGE)).status_code == 403
    assert nobody.get(reverse(FRAGMENT)).status_code == 403
    anonymous = Client()
    for url in (reverse(PAGE), reverse(FRAGMENT)):
        response = anonymous.get(url)
        assert response.status_code == 302 and reverse("admin:login") in response["Location"]
    events_only = staff(django_user_model, "events", "view_lockevent")
    assert events_only.get(reverse(PAGE)).status_code == 403


def test_linked_from_the_locks_list_and_the_app_index(admin_client):
    url = reverse(PAGE)
    assert f'href="{url}"' in admin_client.get(
        reverse("admin:distlock_lock_changelist")).content.decode()
    assert f'href="{url}"' in admin_client.get(
        reverse("admin:app_list", args=["distlock"])).content.decode()


# --- the summary row, the expired locks, the waiters, the clock (issue 34) -------------


def figures(html: str) -> dict[str, str]:
    """The summary row's counts by item, as shown ("3", "12+", "?")."""
    row = html.split('id="distlock-summary"', 1)[1].split("</ul>", 1)[0]
    return dict(re.findall(
        r'id="distlock-summary-(\w+)">.*?<span class="distlock-figure">([^<]*)</span>',
        row, re.DOTALL))


def links(html: str, item: str) -> list[str]:
    block = html.split(f'id="distlock-summary-{item}"', 1)[1].split("</li>", 1)[0]
    return [href.replace("&amp;", "&") for href in re.findall(r'href="([^"]*)"', block)]


def section(html: str, name: str) -> str:
    return html.split(f'id="distlock-{name}"', 1)[1].split('<div class="module"', 1)[0]


def names_in(html: str, name: str, row_class: str) -> list[str]:
    return re.findall(rf'<tr class="{row_class}"><td><a href="[^"]*">([^<]*)</a>',
                      section(html, name))


def test_summary_counts_equal_the_rows_and_link_to_the_filtered_lists(
    django_user_model, settings
):
    settings.DISTLOCK_AUDIT = True
    for n in range(2):
        acquire(f"sum:held-{n}", ttl=600, holder="live")
    for n in range(3):
        expired_lock(f"sum:expired-{n}")
    acquire("sum:free", ttl=60).release()
    for n in range(2):
        record("stale_write", name="sum:held-0", using="default", token=1, detail=str(n))
    record("lost", name="sum:expired-0", using="default", token=1)
    for _ in range(2):
        record("broken", name="sum:held-1", using="default", token=1, by="ops (admin)")
    record("stale_write", name="sum:yesterday", using="default", token=1)
    record("broken", name="sum:yesterday", using="default", token=1)
    now = db_now_us("default")
    LockEvent.objects.filter(name="sum:yesterday").update(
        at_us=overview.midnight_us(now) - 1)

    client = staff(django_user_model, "viewer", "view_lock", "view_lockevent")
    html = client.get(reverse(FRAGMENT)).content.decode()
    states = [row.state for row in locks("default")]
    today = LockEvent.objects.filter(at_us__gte=overview.midnight_us(now))
    expected = {
        "held": states.count("held"), "expired": states.count("expired"),
        "stale": today.filter(kind="stale_write").count(),
        "trouble": today.filter(kind__in=["lost", "broken"]).count(),
    }
    assert expected == {"held": 2, "expired": 3, "stale": 2, "trouble": 3}
    shown = figures(html)
    assert {key: int(shown[key]) for key in expected} == expected
    if connection.vendor == "postgresql":
        assert shown["waiting"] == "0"
    else:
        assert shown["waiting"] == "?"  # nobody can tell here (the waiting note says why)

    locks_url, events_url = (reverse("admin:distlock_lock_changelist"),
                             reverse("admin:distlock_lockevent_changelist"))
    assert links(html, "held") == [f"{locks_url}?state=held"]
    assert links(html, "expired") == [f"{locks_url}?state=expired"]
    assert links(html, "waiting") == ["#distlock-waiting"]
    assert links(html, "stale") == [f"{events_url}?kind=stale_write&age=day"]
    assert links(html, "trouble") == [f"{events_url}?kind=lost&age=day",
                                      f"{events_url}?kind=broken&age=day"]
    assert "1 lost" in html and "2 broken" in html
    # Each link lists what its count counts (within the last 24 hours for the events).
    listed = client.get(links(html, "expired")[0]).content.decode()
    assert all(f"sum:expired-{n}" in listed for n in range(3))
    assert "sum:held-0" not in listed and "sum:free" not in listed
    listed = client.get(links(html, "held")[0]).content.decode()
    assert "sum:held-0" in listed and "sum:held-1" in listed and "sum:expired-0" not in listed
    listed = client.get(links(html, "trouble")[1]).content.decode()
    assert "sum:held-1" in listed and "sum:expired-0" not in listed


def test_the_summary_is_the_first_thing_in_the_fragment(admin_client):
    html = admin_client.get(reverse(FRAGMENT)).content.decode()
    assert html.lstrip().startswith('<ul class="distlock-summary" id="distlock-summary">')
    assert html.index('id="distlock-summary"') < html.index('id="distlock-held"')
    page = admin_client.get(reverse(PAGE)).content.decode()
    assert page.index('id="distlock-summary"') < page.index('id="distlock-held"')


def test_today_counts_are_bounded_by_the_event_window(settings, monkeypatch):
    settings.DISTLOCK_AUDIT = True
    monkeypatch.setattr(overview, "EVENT_WINDOW", 3)
    for _ in range(2):
        record("broken", name="early", using="default", token=1)
    for n in range(3):
        record("lost", name="late", using="default", token=n)
    # Strictly older than the "lost" ones: the window's edge is a time, and on SQLite the
    # clock's millisecond can be the same for the last "broken" and the first "lost".
    LockEvent.objects.filter(kind="broken").update(at_us=F("at_us") - 1000)
    data = overview.overview("default")
    assert data.stale_capped and (data.lost_count, data.broken_count) == (3, 0)


def test_expired_locks_are_listed_most_recently_expired_first(admin_client):
    acquire("exp:held", ttl=600)
    for name in ("exp:first", "exp:second", "exp:third"):
        expired_lock(name, holder=f"{name}-holder")
    taken = expired_lock("exp:taken")
    acquire("exp:taken", ttl=600)  # taken over: held again, not expired
    now = db_now_us("default")
    rows, count = overview.expired_now("default", now, limit=2)
    assert count == 3 and [row.name for row in rows] == ["exp:third", "exp:second"]
    assert all(row.expires_us <= now for row in rows)

    html = admin_client.get(reverse(FRAGMENT)).content.decode()
    assert re.search(r'id="distlock-expired-count">3<', html)
    assert names_in(html, "expired", "distlock-expired-row") == [
        "exp:third", "exp:second", "exp:first"]
    assert "exp:first-holder" in section(html, "expired")
    assert names_in(html, "held", "distlock-held-row") == ["exp:held", "exp:taken"]
    assert len(re.findall(r'<span class="distlock-relative">(?:\d+ s ago|now)</span>',
                          section(html, "expired"))) == 3
    assert taken.token < Lock.objects.get(name="exp:taken").token


def test_most_contended_on_the_page_is_ranked_by_grants(admin_client, settings):
    settings.DISTLOCK_AUDIT = True
    for n in range(6):
        acquire("rank:hot", ttl=60, holder=f"worker-{n % 2}").release()
    for holder in ("a", "b", "c"):
        acquire("rank:spread", ttl=60, holder=holder).release()
    acquire("rank:once", ttl=60, holder="z").release()
    html = admin_client.get(reverse(FRAGMENT)).content.decode()
    assert names_in(html, "contended", "distlock-contended-row") == [
        "rank:hot", "rank:spread", "rank:once"]
    hot = section(html, "contended").split("rank:hot</a>", 1)[1].split("</tr>", 1)[0]
    assert re.match(r"</td><td><a [^>]*>6</a></td><td>0</td><td>2</td>", hot), hot


@pytest.mark.parametrize(("who", "sessions"), [
    ("waiter-0 pid 101, waiter-1 pid 102",
     [{"who": "waiter-0", "server_pid": "101"}, {"who": "waiter-1", "server_pid": "102"}]),
    ("10.0.0.7 pid 55", [{"who": "10.0.0.7", "server_pid": "55"}]),
    ("odd, name pid 7", [{"who": "odd, name", "server_pid": "7"}]),
    ("no pid here", [{"who": "no pid here", "server_pid": ""}]),
    ("a pid 1, garbled", [{"who": "a", "server_pid": "1"},
                          {"who": "garbled", "server_pid": ""}]),
])
def test_waiting_sessions_are_read_apart_from_the_server_pid(who, sessions):
    assert overview_views.waiting_sessions(who) == sessions


def test_waiters_are_named_and_the_server_pid_labelled_on_the_page(admin_client, monkeypatch):
    """Whatever the database: the page shows a waiting session's name, and its pid only
    as the server session's (never like an application's ``pid=``)."""
    acquire("wait:wanted", ttl=600)
    monkeypatch.setattr(overview, "waiting", lambda alias: (
        [("wait:wanted", 2, "billing-worker pid 4242, 10.1.2.3 pid 4243")], "note"))
    html = admin_client.get(reverse(FRAGMENT)).content.decode()
    waiting = section(html, "waiting")
    assert '<span class="distlock-waiter">billing-worker <span class="distlock-quiet">' \
        "server session pid 4242</span></span>" in waiting
    assert "10.1.2.3" in waiting and "server session pid 4243" in waiting
    assert not re.search(r"(?<!session )pid \d", waiting)
    assert figures(html)["waiting"] == "2"


def test_one_clock_the_databases_in_the_site_zone_with_the_zone_shown(
    admin_client, settings
):
    settings.TIME_ZONE = "Asia/Kolkata"
    settings.DISTLOCK_AUDIT = True
    lease = acquire("clock:held", ttl=600)
    record("stale_write", name="clock:held", using="default", token=lease.token)
    expired_lock("clock:expired")
    html = admin_client.get(reverse(FRAGMENT)).content.decode()
    row = Lock.objects.get(name="clock:held")
    expires = timezone.localtime(from_us(row.expires_us), ZoneInfo("Asia/Kolkata"))
    held = section(html, "held")
    assert f"{expires:%H:%M:%S} IST</time>" in held
    assert re.search(r"\d\d:\d\d:\d\d IST</time>", section(html, "expired"))
    assert re.search(r"\d\d:\d\d:\d\d IST</time>", section(html, "stale"))
    assert re.search(r'data-now="\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} IST"', html)
    assert "time zone Asia/Kolkata" in html
    # No time on the page without its zone: every <time> ends with IST.
    shown = re.findall(r"<time[^>]*>([^<]*)</time>", html)
    assert len(shown) >= 4 and all(text.endswith(" IST") for text in shown), shown


def test_midnight_is_the_database_clocks_today_in_the_site_zone(settings):
    settings.TIME_ZONE = "Asia/Kolkata"
    # 2026-12-03 01:30 IST is 2026-12-02 20:00 UTC: today in Kolkata began 01:30 ago.
    now = (datetime(2026, 12, 2, 20, 0, tzinfo=UTC) - EPOCH) // timedelta(microseconds=1)
    assert overview.midnight_us(now) == now - (90 * 60 * 10**6)


def test_only_the_fragment_carries_the_fragment_header(admin_client):
    assert admin_client.get(reverse(FRAGMENT))[overview_views.FRAGMENT_HEADER] == "1"
    assert overview_views.FRAGMENT_HEADER not in admin_client.get(reverse(PAGE))
    signed_out = Client().get(reverse(FRAGMENT))
    assert signed_out.status_code == 302
    assert overview_views.FRAGMENT_HEADER not in signed_out
