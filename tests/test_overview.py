"""The admin's overview page and its queries (distlock/admin/overview.py) on a real database:
what is held, who waits (PostgreSQL's registrations, played by hand with real sessions),
what is most contended and which stale writes were refused, each within its bounds."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.urls import reverse

from distlock import acquire
from distlock.admin import overview
from distlock.db import db_now_us
from distlock.models import LockEvent
from distlock.ops.audit import record
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
    acquire("old", ttl=60, holder="x").release()
    LockEvent.objects.filter(name="old").update(at_us=db_now_us("default") - 2 * 3600 * 10**6)
    data = overview.overview("default")
    got = [(item.name, item.holders, item.grants) for item in data.contended]
    assert got == [("busy", 3, 3), ("solo", 1, 4)]  # most holders first; "old" is too old
    assert not data.contended_capped


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
    LockEvent.objects.filter(name="yesterday").update(at_us=overview.midnight_us() - 1)
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
def test_waiting_sessions_on_postgresql():
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
