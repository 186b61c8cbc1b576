"""The lock and audit admin pages through Django's test client, on a real database.

Every list column, filter, search and action is exercised; breaking goes all the way to
the database and back (the broken lease's renew and release fail, the next token is
higher); permissions and CSRF are checked with real users and sessions.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from html import unescape
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils.timezone import localtime

from distlock import LockLost, StaleToken, acquire, break_lock
from distlock.admin.search import check_term, prefix_end
from distlock.core.status import EXPIRED, FREE, HELD, STATES, locks, state_is
from distlock.db import db_now_us
from distlock.models import Lock, LockEvent
from distlock.ops.audit import record
from distlock.times import from_us
from tests.support.helpers import expired_lock

pytestmark = pytest.mark.usefixtures("lock_db")

CHANGELIST = "admin:distlock_lock_changelist"
EVENTS = "admin:distlock_lockevent_changelist"


def rows(response) -> dict[str, str]:
    """The changelist's result rows, keyed by the lock name in the first cell."""
    html = response.content.decode()
    body = html[html.index('id="result_list"'):]
    found = {}
    for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S):
        cell = re.search(r'<th class="field-(?:name|at)"[^>]*>(?:<a [^>]*>)?([^<]*)', row)
        if cell:
            found[cell.group(1)] = row
    return found


def result_names(response) -> list[str]:
    return [obj.pk for obj in response.context["cl"].result_list]


def messages_of(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def user_with(django_user_model, username: str, *codenames: str):
    user = django_user_model.objects.create_user(username, password="pw", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


@pytest.fixture
def superuser(django_user_model):
    return django_user_model.objects.create_superuser("root", "root@example.com", "pw")


@pytest.fixture
def su_client(superuser) -> Client:
    client = Client()
    client.force_login(superuser)
    return client


def post_action(client: Client, names: list[str], **extra) -> object:
    data = {"action": "break_selected", "_selected_action": names, "index": "0", **extra}
    return client.post(reverse(CHANGELIST), data)


def confirm(client: Client, response, *, follow: bool = True):
    """Submit the confirmation form exactly as the page rendered it."""
    html = response.content.decode()
    form = html[html.index('<form method="post">'):]
    data: dict[str, list[str]] = {}
    for name, value in re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', form):
        data.setdefault(name, []).append(value.replace("&quot;", '"').replace("&amp;", "&"))
    return client.post(reverse(CHANGELIST), data, follow=follow)


# --- the list -----------------------------------------------------------------------


def test_changelist_shows_every_column(su_client, three_locks):
    held, expired, free = three_locks
    response = su_client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    found = rows(response)
    assert set(found) == {"job:held", "job:expired", "job:free"}

    row = found["job:held"]
    assert "distlock-held" in row and ">held<" in row
    assert "worker-A" in row  # holder description
    # The owner cut to 8 hex digits under the holder, all of it on hover only.
    assert f'title="{held.owner}">{held.owner[:8]}…</code>' in row
    assert f">{held.owner}<" not in row
    assert f'<td class="field-token">{held.token}</td>' in row
    expires = re.search(r'field-expires">(.*?)</td>', row).group(1)
    assert re.search(r'<span class="distlock-relative">in (2\d|30) s</span>', expires)
    acquired = re.search(r'field-acquired">(.*?)</td>', row).group(1)
    # Today: the time, to the second, with the site's zone.
    assert re.search(r'>\d\d:\d\d:\d\d [A-Z][A-Za-z+0-9-]*</time>', acquired)
    assert f'datetime="{localtime(held.acquired_at).isoformat()}"' in acquired
    assert re.search(r'field-renewed">once<span class="distlock-relative">(now|\d s ago)<', row)

    row = found["job:expired"]
    assert "distlock-expired" in row and "sleepy" in row
    assert re.search(r'distlock-relative">(now|\d+ s ago)<', row)
    assert f'<td class="field-token">{expired.token}</td>' in row
    assert "field-renewed\"><span class=\"distlock-quiet\">never<" in row

    row = found["job:free"]
    assert "distlock-free" in row
    assert re.search(r"freed (now|\d+ s ago)", row)  # audit off: release or break unknown
    assert "distlock-owner" not in row


def test_state_is_computed_by_the_database(su_client, three_locks):
    response = su_client.get(reverse(CHANGELIST))
    states = {obj.pk: obj.state for obj in response.context["cl"].result_list}
    assert states == {"job:held": "held", "job:expired": "expired", "job:free": "free"}
    # The clock the page used is the database's, read in the listing query.
    page_now = response.context["cl"].result_list[0].db_now_us
    assert abs(page_now - db_now_us("default")) < 60_000_000


@pytest.mark.parametrize("state", ["held", "expired", "free"])
def test_filter_by_state(su_client, three_locks, state):
    response = su_client.get(reverse(CHANGELIST), {"state": state})
    assert result_names(response) == [f"job:{state}"]


def test_state_filters_agree_with_the_badge(three_locks):
    """The filters compare columns with one reading of the clock (so an index or an early
    stop can serve them), the badge is the database's CASE: each row is in the filter of
    its badge and no other; an expired row is not held."""
    now = db_now_us("default")
    shown = {row.name: row.state for row in locks("default")}
    assert shown == {"job:held": HELD, "job:expired": EXPIRED, "job:free": FREE}
    for state in STATES:
        found = Lock.objects.filter(state_is(state, now)).values_list("name", flat=True)
        assert set(found) == {name for name, badge in shown.items() if badge == state}


def test_state_filter_refuses_an_unknown_state():
    with pytest.raises(ValueError, match="held, expired, free"):
        state_is("stuck", 0)


def test_filter_offers_the_three_states(su_client, three_locks):
    html = su_client.get(reverse(CHANGELIST)).content.decode()
    for state in ("held", "expired", "free"):
        assert f"?state={state}" in html


@pytest.mark.parametrize(
    ("query", "expected"),
    [("job:", ["job:expired", "job:free", "job:held"]), ("job:h", ["job:held"]),
     ("  job:f ", ["job:free"]), ("=job:free", ["job:free"]), ("=job:f", []),
     ("JOB:", []), ("ob:", []), ("", ["job:expired", "job:free", "job:held"])],
)
def test_search_is_a_case_sensitive_name_prefix(su_client, three_locks, query, expected):
    response = su_client.get(reverse(CHANGELIST), {"q": query})
    assert result_names(response) == expected
    assert "The start of a lock name, case-sensitive" in response.content.decode()


def test_search_does_not_look_at_holder_or_owner(su_client, three_locks):
    # Names only: holder and owner have no index, a search of them scans the table.
    for query in ("worker-A", three_locks[0].owner):
        assert result_names(su_client.get(reverse(CHANGELIST), {"q": query})) == []


# Names that stress a prefix found as an index range: case, LIKE's wildcards, ":" and
# "-" (which linguistic collations weigh last), accents, U+D7FF (the next code point is a
# surrogate) and U+10FFFF (no next code point).
HOSTILE = [
    "inv", "inv:1", "inv:10", "inv:2", "Inv:1", "INV:1", "inv;", "inv:%", "inv:_x", "inv%1",
    "inv_1", "invé", "inv:é", "a b", "a-b", "a:b", "ab", "B", "\ud7ff", "\ud7ffx",
    "\ue000", "z\U0010ffff", "z\U0010ffffa", "{", "\U0010ffff", "\U0010ffff\U0010ffff",
]


@pytest.mark.parametrize(
    "term",
    ["inv", "inv:", "inv:1", "Inv", "inv:%", "inv%", "inv_", "inv:_", "inv:é", "a", "a:",
     "a-", "\ud7ff", "z", "z\U0010ffff", "\U0010ffff", "\U0010ffff\U0010ffff", "{", "y"],
)
def test_search_prefix_finds_exactly_the_names_that_start_with_it(su_client, term):
    for name in HOSTILE:
        acquire(name, ttl=30).release()
    found = result_names(su_client.get(reverse(CHANGELIST), {"q": term}))
    wanted = [name for name in HOSTILE if name.startswith(term)]
    assert sorted(found) == sorted(wanted)
    if term in HOSTILE:
        assert found[0] == term  # the exact name first


@pytest.mark.parametrize(
    ("term", "says"),
    [("x" * 300, "300 characters long"), ("=", "empty")],
)
def test_search_term_no_name_can_match_says_why(su_client, three_locks, term, says):
    response = su_client.get(reverse(CHANGELIST), {"q": term})
    assert response.status_code == 200
    assert result_names(response) == []
    [message] = messages_of(response)
    assert message.startswith("Nothing was searched: no lock name can match")
    assert says in message


def test_search_term_with_a_nul_is_refused_by_django_with_a_message(su_client, three_locks):
    # Django's own search form drops it (and lists everything); the search never sees it.
    response = su_client.get(reverse(CHANGELIST), {"q": "job:\x00"})
    assert response.status_code == 200
    assert messages_of(response) == ["Null characters are not allowed."]


@pytest.mark.parametrize(
    ("term", "says"),
    [("inv\x00:1", "“inv\\x00:1”"), ("\ud800x", "“\\ud800x”"), ("y" * 999, "(999 characters)")],
)
def test_check_term_quotes_a_bad_term_readably(term, says):
    with pytest.raises(ValueError, match="no lock name can match") as caught:
        check_term(term)
    assert says in str(caught.value)


def test_ordering_by_name_by_default_never_by_state(su_client, three_locks):
    response = su_client.get(reverse(CHANGELIST))
    assert result_names(response) == ["job:expired", "job:free", "job:held"]
    html = response.content.decode()
    assert 'class="sortable column-name' in html
    assert 'class="column-state_badge"' in html  # no sort link: a CASE over every row
    # Column 2 is the state badge: asking to sort by it keeps the name order.
    response = su_client.get(reverse(CHANGELIST), {"o": "-2"})
    assert result_names(response) == ["job:expired", "job:free", "job:held"]


def test_other_columns_sort_only_the_held_or_expired_locks(su_client, three_locks):
    """Over every row (or the free ones) a sort by holder, token or a time would sort the
    whole table (462 ms at a million rows): only the name, the primary key, is offered,
    and a forged ?o= of another column keeps the name order. Within held or expired, read
    through the owned rows' index, every column but the state sorts."""
    for extra in ({"o": "-4"}, {"o": "-4.1"}, {"o": "x.-99.-4"}, {"state": "free", "o": "-4"}):
        response = su_client.get(reverse(CHANGELIST), extra)
        names = result_names(response)
        assert names == sorted(names), extra
        html = response.content.decode()
        assert 'class="sortable column-name' in html
        assert "sortable column-token" not in html and "sortable column-holder_cut" not in html
    acquire("job:held2", ttl=60, holder="worker-B").renew()
    response = su_client.get(reverse(CHANGELIST), {"state": "held", "o": "-4"})  # token
    tokens = [obj.token for obj in response.context["cl"].result_list]
    assert tokens == sorted(tokens, reverse=True) and len(tokens) == 2
    html = response.content.decode()
    for column in ("holder_cut", "token", "acquired", "expires", "renewed"):
        assert f"sortable column-{column}" in html
    assert 'class="column-state_badge"' in html
    response = su_client.get(reverse(CHANGELIST), {"state": "expired", "o": "3"})
    assert result_names(response) == ["job:expired"]


def test_no_add_no_edit_no_delete(su_client, three_locks):
    held = three_locks[0]
    change = reverse("admin:distlock_lock_change", args=[held.name])
    response = su_client.get(change)
    assert response.status_code == 200
    html = response.content.decode()
    assert held.owner in html and str(held.token) in html and "worker-A" in html
    assert 'name="token"' not in html and 'name="_save"' not in html
    assert "events of this lock" in html
    assert su_client.post(change, {"token": "1", "owner": ""}).status_code == 403
    assert su_client.get(reverse("admin:distlock_lock_add")).status_code == 403
    delete = reverse("admin:distlock_lock_delete", args=[held.name])
    assert su_client.post(delete, {"post": "yes"}).status_code == 403
    row = Lock.objects.get(name=held.name)
    assert (row.owner, row.token) == (held.owner, held.token)
    actions = su_client.get(reverse(CHANGELIST)).context["action_form"].fields["action"]
    assert [value for value, _ in actions.choices if value] == ["break_selected"]


def test_bulk_delete_post_is_refused(su_client, three_locks):
    response = su_client.post(
        reverse(CHANGELIST),
        {"action": "delete_selected", "_selected_action": ["job:free"], "index": "0",
         "post": "yes"},
        follow=True,
    )
    assert "No action selected." in messages_of(response)
    assert Lock.objects.filter(name="job:free").exists()


# --- breaking -----------------------------------------------------------------------


def test_break_through_the_confirmation_page(su_client, superuser, settings):
    settings.DISTLOCK_AUDIT = True
    lease = acquire("invoice:42", ttl=30, holder="payer")
    page = post_action(su_client, ["invoice:42"])
    assert page.status_code == 200
    html = page.content.decode()
    assert "Break locks?" in html and "payer" in html and lease.owner in html
    assert "Yes, break 1 lock" in html
    assert Lock.objects.get(name="invoice:42").owner == lease.owner  # nothing yet

    done = confirm(su_client, page)
    assert done.redirect_chain and done.redirect_chain[-1][0].startswith(reverse(CHANGELIST))
    assert any("Broke 1 lock(s): invoice:42" in m for m in messages_of(done))
    assert Lock.objects.get(name="invoice:42").owner == ""

    with pytest.raises(LockLost):
        lease.renew()
    assert lease.release() is False
    again = acquire("invoice:42", ttl=30)
    assert again.token == lease.token + 1

    # With audit on, the audit is the lock's one history: the break is there, by whom,
    # and not in Django's log as well.
    assert not LogEntry.objects.filter(object_id="invoice:42").exists()
    event = LockEvent.objects.get(name="invoice:42", kind="broken")
    assert event.by == "root (admin)" and event.token == lease.token
    assert event.holder.endswith("payer")


def test_break_an_expired_lock(su_client):
    lease = expired_lock("stuck")
    done = confirm(su_client, post_action(su_client, ["stuck"]))
    assert any("Broke 1 lock(s)" in m for m in messages_of(done))
    assert Lock.objects.get(name="stuck").owner == ""
    assert lease.release() is False


def test_lock_that_changed_hands_is_not_broken(su_client):
    first = acquire("moving", ttl=30)
    page = post_action(su_client, ["moving"])
    assert first.owner in page.content.decode()
    first.release()
    second = acquire("moving", ttl=30, holder="newcomer")
    done = confirm(su_client, page)
    notes = messages_of(done)
    assert any("Did not break “moving”: it changed hands" in m for m in notes)
    assert any(f"token {second.token}" in m for m in notes)
    row = Lock.objects.get(name="moving")
    assert (row.owner, row.token) == (second.owner, second.token)
    second.renew()  # still the holder
    assert not LogEntry.objects.filter(object_id="moving").exists()


def test_lock_freed_since_the_page_was_shown_is_reported(su_client):
    lease = acquire("gone", ttl=30)
    page = post_action(su_client, ["gone"])
    lease.release()
    done = confirm(su_client, page)
    assert any("it is now free" in m for m in messages_of(done))


def test_selecting_only_free_locks_offers_nothing_to_break(su_client, three_locks):
    page = post_action(su_client, ["job:free"])
    html = page.content.decode()
    assert "Already free, nothing to break" in html and "job:free" in html
    assert "distlock-confirm-break" not in html
    done = confirm(su_client, page)
    assert "None of the selected locks was held." in messages_of(done)


def test_break_several_at_once(su_client, three_locks):
    held, expired, _ = three_locks
    page = post_action(su_client, ["job:held", "job:expired", "job:free"])
    assert "Yes, break 2 locks" in page.content.decode()
    done = confirm(su_client, page)
    assert any("Broke 2 lock(s)" in m for m in messages_of(done))
    assert set(Lock.objects.values_list("owner", flat=True)) == {""}
    assert LogEntry.objects.filter(object_id__in=["job:held", "job:expired"]).count() == 2


@pytest.mark.parametrize(
    "expect",
    [
        "not json",
        json.dumps(["x", "0" * 31, 1]),
        json.dumps(["x", "0" * 32, 0]),
        json.dumps(["x", "0" * 32]),
        json.dumps(["", "0" * 32, 5]),
    ],
)
def test_malformed_confirmation_breaks_nothing(su_client, expect):
    lease = acquire("x", ttl=30)
    data = {"action": "break_selected", "_selected_action": ["x"], "post": "yes",
            "expect": [json.dumps(["x", lease.owner, lease.token]), expect]}
    done = su_client.post(reverse(CHANGELIST), data, follow=True)
    assert "The confirmation was malformed; nothing was broken." in messages_of(done)
    assert Lock.objects.get(name="x").owner == lease.owner


def test_confirmation_only_breaks_selected_names(su_client):
    a = acquire("a", ttl=30)
    b = acquire("b", ttl=30)
    data = {"action": "break_selected", "_selected_action": ["a"], "post": "yes",
            "expect": [json.dumps(["a", a.owner, a.token]), json.dumps(["b", b.owner, b.token])]}
    su_client.post(reverse(CHANGELIST), data)
    assert Lock.objects.get(name="a").owner == ""
    assert Lock.objects.get(name="b").owner == b.owner


# --- permissions --------------------------------------------------------------------


def test_anonymous_gets_the_login_page():
    lease = acquire("anon", ttl=30)
    client = Client()
    response = client.get(reverse(CHANGELIST))
    assert response.status_code == 302 and reverse("admin:login") in response["Location"]
    data = {"action": "break_selected", "_selected_action": ["anon"], "post": "yes",
            "expect": [json.dumps(["anon", lease.owner, lease.token])]}
    response = client.post(reverse(CHANGELIST), data)
    assert response.status_code == 302 and reverse("admin:login") in response["Location"]
    assert Lock.objects.get(name="anon").owner == lease.owner


def test_staff_without_break_permission_has_no_action_and_forged_post_fails(
    django_user_model,
):
    lease = acquire("guarded", ttl=30)
    client = Client()
    client.force_login(user_with(django_user_model, "viewer", "view_lock"))
    response = client.get(reverse(CHANGELIST))
    assert response.status_code == 200 and result_names(response) == ["guarded"]
    assert "break_selected" not in response.content.decode()
    assert "action_form" not in response.context or response.context["action_form"] is None

    # Step one (ask for the page) and step two (confirm), forged by hand: each is
    # answered with the list and Django's "No action selected." (as the README says).
    step_one = client.post(
        reverse(CHANGELIST),
        {"action": "break_selected", "_selected_action": ["guarded"], "index": "0"},
        follow=True,
    )
    assert step_one.status_code == 200 and "Break locks?" not in step_one.content.decode()
    assert messages_of(step_one) == ["No action selected."]
    assert result_names(step_one) == ["guarded"]
    data = {"action": "break_selected", "_selected_action": ["guarded"], "post": "yes",
            "expect": [json.dumps(["guarded", lease.owner, lease.token])]}
    for forged in (data, {**data, "index": "0"}):
        done = client.post(reverse(CHANGELIST), forged, follow=True)
        assert messages_of(done) == ["No action selected."]
        assert "No action selected." in done.content.decode()  # shown on the page
    # Without an action named, a POST is not taken for one.
    plain = client.post(reverse(CHANGELIST), {"q": "guarded"}, follow=True)
    assert plain.status_code == 200 and messages_of(plain) == []
    row = Lock.objects.get(name="guarded")
    assert (row.owner, row.token) == (lease.owner, lease.token)
    assert not LogEntry.objects.exists()


def test_every_permission_but_break_does_not_break_by_the_list_or_the_lock_page(
    django_user_model,
):
    """All of distlock's other permissions (change and delete among them) give no break."""
    lease = acquire("guarded:all-but", ttl=30)
    others = Permission.objects.filter(content_type__app_label="distlock").exclude(
        codename="break_lock"
    )
    codenames = sorted(permission.codename for permission in others)
    assert {"view_lock", "change_lock", "delete_lock"} <= set(codenames)
    client = Client()
    client.force_login(user_with(django_user_model, "almost", *codenames))
    listed = client.get(reverse(CHANGELIST))
    assert listed.status_code == 200 and result_names(listed) == ["guarded:all-but"]
    assert "break_selected" not in listed.content.decode()
    expect = [json.dumps(["guarded:all-but", lease.owner, lease.token])]
    confirmed = client.post(
        reverse(CHANGELIST),
        {"action": "break_selected", "_selected_action": ["guarded:all-but"], "post": "yes",
         "expect": expect},
        follow=True,
    )
    assert messages_of(confirmed) == ["No action selected."]
    # The lock's own page shows it read-only; a POST there (the action's fields, or a
    # cleared owner) is refused.
    page = reverse("admin:distlock_lock_change", args=[quote("guarded:all-but")])
    assert client.get(page).status_code == 200
    for forged in ({"action": "break_selected", "post": "yes", "expect": expect},
                   {"owner": "", "token": lease.token}):
        assert client.post(page, forged).status_code == 403
    row = Lock.objects.get(name="guarded:all-but")
    assert (row.owner, row.token) == (lease.owner, lease.token)
    assert not LogEntry.objects.exists()
    assert lease.release() is True


def test_staff_without_view_permission_is_forbidden(django_user_model):
    client = Client()
    client.force_login(user_with(django_user_model, "nobody"))
    assert client.get(reverse(CHANGELIST)).status_code == 403
    assert client.get(reverse(EVENTS)).status_code == 403


def test_staff_with_the_break_permission_can_break(django_user_model):
    lease = acquire("ops", ttl=30)
    client = Client()
    client.force_login(user_with(django_user_model, "operator", "view_lock", "break_lock"))
    done = confirm(client, post_action(client, ["ops"]))
    assert any("Broke 1 lock(s)" in m for m in messages_of(done))
    assert lease.release() is False


def test_csrf_is_enforced(superuser):
    lease = acquire("csrf", ttl=30)
    client = Client(enforce_csrf_checks=True)
    client.force_login(superuser)
    data = {"action": "break_selected", "_selected_action": ["csrf"], "post": "yes",
            "expect": [json.dumps(["csrf", lease.owner, lease.token])]}
    assert client.post(reverse(CHANGELIST), data).status_code == 403
    assert Lock.objects.get(name="csrf").owner == lease.owner
    # With the token the page carries, the same request works.
    page = client.post(
        reverse(CHANGELIST),
        {"action": "break_selected", "_selected_action": ["csrf"], "index": "0",
         "csrfmiddlewaretoken": client.get(reverse(CHANGELIST)).context["csrf_token"]},
    )
    assert page.status_code == 200
    confirm(client, page)
    assert Lock.objects.get(name="csrf").owner == ""


# --- the audit history admin --------------------------------------------------------


@pytest.fixture
def events(settings):
    settings.DISTLOCK_AUDIT = True
    lease = acquire("ev:one", ttl=30, holder="alpha")
    lease.renew()
    lease.release()
    other = acquire("ev:two", ttl=30, holder="beta")
    break_lock("ev:two", by="carol")
    assert other.release() is False
    return lease, other


def test_event_list_columns(su_client, events):
    lease, _ = events
    response = su_client.get(reverse(EVENTS), {"kind": "all"})
    assert response.status_code == 200
    html = response.content.decode()
    kinds = [(obj.name, obj.kind) for obj in response.context["cl"].result_list]
    assert ("ev:one", "acquired") in kinds and ("ev:one", "renewed") in kinds
    assert ("ev:one", "released") in kinds and ("ev:two", "broken") in kinds
    assert "distlock-broken" in html and ">broken<" in html
    assert "by carol" in html and "alpha" in html  # who broke it, in the detail column
    assert f'<td class="field-token">{lease.token}</td>' in html
    # To the second in the list, to the millisecond (and the zone) on hover.
    assert re.search(r'field-at"[^>]*><a [^>]*><time class="distlock-when" datetime="[^"]+" '
                     r'title="\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \w+">'
                     r"\d\d:\d\d:\d\d \w+</time>", html)
    assert "released" in html and "expires " in html  # detail of the renewal


def test_event_filters_and_search(su_client, events):
    url = reverse(EVENTS)
    broken = su_client.get(url, {"kind": "broken"}).context["cl"].result_list
    assert [(e.name, e.by) for e in broken] == [("ev:two", "carol")]
    recent = su_client.get(url, {"age": "hour", "kind": "all"}).context["cl"].result_list
    assert len(recent) == LockEvent.objects.count() >= 5
    LockEvent.objects.update(at_us=db_now_us("default") - 2 * 86400 * 1_000_000)
    assert list(su_client.get(url, {"age": "day"}).context["cl"].result_list) == []
    assert len(su_client.get(url, {"age": "week"}).context["cl"].result_list) >= 4
    named = su_client.get(url, {"name__exact": "ev:one"}).context["cl"].result_list
    # Acquired and released; the renewal between them only on request.
    assert {e.name for e in named} == {"ev:one"} and len(named) == 2


def _page_plan(response) -> str:
    """The database's plan of the list's page query (SQLite and PostgreSQL)."""
    from django.db import connection

    query = response.context["cl"].result_list.query
    sql, params = query.sql_with_params()
    explain = "EXPLAIN QUERY PLAN " if connection.vendor == "sqlite" else "EXPLAIN "
    with connection.cursor() as cursor:
        cursor.execute(explain + sql, params)
        return "\n".join(" ".join(map(str, row)) for row in cursor.fetchall())


@pytest.mark.parametrize("param", ["kind", "kind__exact"])
def test_a_rare_kind_is_listed_through_its_index(su_client, events, param):
    """?kind=broken (and the sidebar's own link) lists exactly the broken events, through
    the rare kinds' partial index (migration 0001) on PostgreSQL and SQLite: without it,
    at 10M events, 1.7 s and 18 s (docs/performance.md)."""
    from django.db import connection

    from distlock.constants import RARE_EVENTS_INDEX

    url = reverse(EVENTS)
    LockEvent.objects.bulk_create(
        LockEvent(at_us=i, kind=LockEvent.Kind.RENEWED, name=f"ev:many:{i}") for i in range(300)
    )
    response = su_client.get(url, {param: "broken"})
    assert [(e.name, e.kind) for e in response.context["cl"].result_list] == [
        ("ev:two", "broken")]
    renewed = su_client.get(url, {param: "renewed"}).context["cl"].result_list
    assert len(renewed) == 100 and {e.kind for e in renewed} == {"renewed"}
    assert su_client.get(url, {param: "nonsense"}).context["cl"].result_list.count() == 0
    if connection.vendor == "mysql":
        return  # a full index, whose use MariaDB's optimizer decides by its statistics
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET enable_seqscan = off")  # a small table: it would scan it
        try:
            assert RARE_EVENTS_INDEX in _page_plan(su_client.get(url, {param: "broken"}))
            assert RARE_EVENTS_INDEX in _page_plan(
                su_client.get(url, {param: "stale_write", "age": "week"}))
            assert RARE_EVENTS_INDEX not in _page_plan(su_client.get(url, {param: "renewed"}))
        finally:
            if connection.vendor == "postgresql":
                cursor.execute("RESET enable_seqscan")


def listed_kinds(response) -> list[str]:
    """The kinds of the list's rows, as their badges name them in the page."""
    html = response.content.decode()
    body = html[html.index('id="result_list"'):]
    return re.findall(r'<td class="field-kind_badge"><span class="distlock-badge distlock-(\w+)"',
                      body)


def filter_link(response, text: str) -> str:
    """The href of the kind filter's link whose text is ``text``."""
    html = response.content.decode()
    sidebar = html[html.index('id="changelist-filter"'):]
    link = rf'<a (?:class="[^"]*" )?href="([^"]*)"[^>]*>{re.escape(text)}</a>'
    found = re.findall(link, sidebar)
    assert len(found) == 1, (text, found)
    return reverse(EVENTS) + unescape(found[0])


def visible_text(response) -> str:
    """What a reader sees: the page without its tags, scripts and attributes."""
    html = response.content.decode()
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    return unescape(re.sub(r"<[^>]+>", " ", html))


@pytest.fixture
def renewals(settings):
    settings.DISTLOCK_AUDIT = True
    lease = acquire("ren:1", ttl=30)
    lease.renew()
    lease.renew()
    assert lease.release() is True
    return lease


def test_renewals_are_hidden_by_default_and_shown_on_request(su_client, renewals):
    """Issue 34: an auto-renewing holder's renewals filled the events list."""
    default = su_client.get(reverse(EVENTS))
    assert listed_kinds(default) == ["released", "acquired"]
    html = default.content.decode()
    assert re.search(r'<li class="selected">\s*<a href="\?">all but renewals</a>', html)
    assert 'aria-checked="false" title="show renewed events">☐ renewed<' in html
    every = su_client.get(filter_link(default, "all, with renewals"))
    assert listed_kinds(every) == ["released", "renewed", "renewed", "acquired"]
    assert every.context["cl"].result_count == 4
    only = su_client.get(filter_link(default, "only renewals"))
    assert listed_kinds(only) == ["renewed", "renewed"]
    # Ticking "renewed" in the default view adds them: every kind.
    ticked = su_client.get(filter_link(default, "☐ renewed"))
    assert listed_kinds(ticked) == listed_kinds(every)
    # And back: "all but renewals" from there is the default again.
    assert listed_kinds(su_client.get(filter_link(every, "all but renewals"))) == [
        "released", "acquired"]


def test_several_kinds_at_once(su_client, events, renewals):
    url = reverse(EVENTS)
    for query in ({"kind": ["broken", "released"]}, {"kind": "broken,released"},
                  {"kind__in": "broken,released"}, {"kind__exact": "broken", "kind": "released"}):
        response = su_client.get(url, query)
        assert sorted(listed_kinds(response)) == ["broken", "released", "released"], query
        html = response.content.decode()
        ticked = re.findall(r'aria-checked="true"[^>]*>☑ ([^<]+)<', html)
        assert ticked == ["released", "broken"], query
    broken = su_client.get(url, {"kind": "broken"})
    assert listed_kinds(broken) == ["broken"]
    # Tick "renewed" beside it, then show "released" alone.
    both = su_client.get(filter_link(broken, "☐ renewed"))
    assert sorted(listed_kinds(both)) == ["broken", "renewed", "renewed", "renewed"]
    untick = su_client.get(filter_link(both, "☑ broken"))
    assert listed_kinds(untick) == ["renewed"] * 3
    html = both.content.decode()
    only = re.search(r'href="([^"]*)" title="only released events"', html).group(1)
    assert listed_kinds(su_client.get(url + unescape(only))) == ["released", "released"]


def test_several_rare_kinds_are_listed_through_their_index(su_client, events):
    """Rare kinds together keep the rare kinds' index (SQLite needs the condition's terms
    in the query); a rare and a common one cannot use it and must still list both; the
    default list is read as the whole list is, by time, with no more queries."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from distlock.constants import RARE_EVENTS_INDEX

    url = reverse(EVENTS)
    LockEvent.objects.bulk_create(
        LockEvent(at_us=i, kind=LockEvent.Kind.RENEWED, name=f"ev:many:{i}") for i in range(300)
    )
    rare = su_client.get(url, {"kind": ["broken", "lost"]})
    assert listed_kinds(rare) == ["broken"]
    mixed = su_client.get(url, {"kind": ["broken", "acquired"]})
    assert sorted(listed_kinds(mixed)) == ["acquired", "acquired", "broken"]
    with CaptureQueriesContext(connection) as every:
        assert len(listed_kinds(su_client.get(url, {"kind": "all"}))) == 100
    with CaptureQueriesContext(connection) as default:
        assert "renewed" not in listed_kinds(su_client.get(url))
    assert len(default.captured_queries) == len(every.captured_queries)
    if connection.vendor == "mysql":
        return  # a full index, whose use MariaDB's optimizer decides by its statistics
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET enable_seqscan = off")
        try:
            assert RARE_EVENTS_INDEX in _page_plan(rare)
            assert RARE_EVENTS_INDEX in _page_plan(
                su_client.get(url, {"kind__in": "stale_write,took_over", "age": "week"}))
            assert RARE_EVENTS_INDEX not in _page_plan(mixed)
            if connection.vendor == "sqlite":
                # By the time index, newest first, as the whole list is: no sort.
                def steps(response) -> list[str]:
                    return re.sub(r"^[\d ]+", "", _page_plan(response), flags=re.M).split("\n")

                plan = steps(su_client.get(url))
                assert plan == steps(su_client.get(url, {"kind": "all"}))
                assert "at_us" in plan[0] and not any("TEMP B-TREE" in s for s in plan)
        finally:
            if connection.vendor == "postgresql":
                cursor.execute("RESET enable_seqscan")


def test_event_names_link_to_their_lock(su_client, events):
    """To the lock's page; for a lock whose row is gone (purged), to the Locks list
    searched for exactly that name."""
    Lock.objects.filter(name="ev:two").delete()
    response = su_client.get(reverse(EVENTS))
    cells = re.findall(r'<td class="field-lock_link">(.*?)</td>', response.content.decode())
    one = reverse("admin:distlock_lock_change", args=[quote("ev:one")])
    two = reverse(CHANGELIST) + "?q=%3Dev%3Atwo"
    assert cells == [f'<a href="{two}" title="no lock row (purged): the Locks list, '
                     'searched">ev:two</a>'] * 2 + [
        f'<a href="{one}" title="the lock\'s page">ev:one</a>'] * 2
    page = su_client.get(one)
    assert page.status_code == 200 and page.context["original"].name == "ev:one"
    searched = su_client.get(unescape(two))
    assert searched.status_code == 200 and result_names(searched) == []
    acquire("ev:two", ttl=30).release()
    assert result_names(su_client.get(unescape(two))) == ["ev:two"]


def test_stale_writes_say_why_and_by_their_label(su_client, settings):
    """Issue 34: each refused write's detail says why (the lease expired, the lock was
    taken over, broken, released), and the page shows the kind by its label, never the
    code "stale_write": not in the list, its filter, an event's page or its history."""
    from distlock.testing import make_stale, take_over
    from tests.testapp.models import Account

    settings.DISTLOCK_AUDIT = True
    reasons = []
    for end in ("expired", "taken over", "broken", "released"):
        account = Account.objects.create()
        lease = acquire(f"account:{account.pk}", ttl=30)
        if end == "expired":
            make_stale(lease)
            reasons.append("lease expired")
        elif end == "taken over":
            reasons.append(f"lock now at token {take_over(lease).token}")
        elif end == "broken":
            break_lock(lease.name, by="ops")
            reasons.append("lease broken")
        else:
            lease.release()
            reasons.append("lock released")
        with pytest.raises(StaleToken):
            account.save(fence=lease)
    response = su_client.get(reverse(EVENTS), {"kind": "stale_write"})
    html = response.content.decode()
    details = re.findall(r'<td class="field-detail_cut"><span [^>]*>([^<]*)</span>', html)
    assert [re.search(r"refused: (.*) \(", d).group(1) for d in details] == reasons[::-1]
    assert listed_kinds(response) == ["stale_write"] * 4
    # The four rows and the filter's box.
    assert visible_text(response).count("stale write refused") == 4 + 1
    event = LockEvent.objects.filter(kind="stale_write").first()
    for page in (response, su_client.get(reverse(EVENTS)),
                 su_client.get(reverse("admin:distlock_lockevent_change", args=[event.pk])),
                 su_client.get(reverse("admin:distlock_lockevent_history", args=[event.pk]))):
        assert page.status_code == 200
        assert "stale_write" not in visible_text(page)
    page = su_client.get(reverse("admin:distlock_lockevent_change", args=[event.pk]))
    heading = f"{event.name}: stale write refused (token {event.token})"
    assert f"<h2>{heading}</h2>" in page.content.decode()
    # The last crumb, in the running Django's breadcrumb markup (distlock_breadcrumbs).
    assert crumbs(page)[-1] == heading


def crumbs(response) -> list[str]:
    """The texts of a page's breadcrumbs, after checking that they are written as the
    running Django's admin writes its own: a ``div`` up to 6.0, an ``ol`` from 6.1."""
    import django

    from distlock.templatetags import distlock_admin

    html = response.content.decode()
    found = re.search(r'<(div|ol) class="breadcrumbs">(.*?)</\1>', html, re.S)
    assert found is not None, "no breadcrumbs"
    listed = django.VERSION[:2] >= distlock_admin.LISTED_FROM
    assert found.group(1) == ("ol" if listed else "div"), found.group(0)
    inner = found.group(2)
    parts = (re.findall(r"<li[^>]*>(.*?)</li>", inner, re.S) if listed
             else inner.split("&rsaquo;"))
    return [unescape(re.sub(r"<[^>]+>", "", part)).strip() for part in parts]


@pytest.mark.parametrize("listed", [False, True], ids=["div", "ol"])
def test_event_pages_write_the_running_djangos_breadcrumbs(
    su_client, events, monkeypatch, listed
):
    """Issue 34: an event's page and its history wrote ``<div class="breadcrumbs">`` by
    hand, which Django 6.1's stylesheet no longer styles; they take the markup of the
    running Django from ``{% distlock_breadcrumbs %}`` as distlock's other pages do (the
    ``ol`` is forced here on any Django)."""
    import django

    from distlock.templatetags import distlock_admin

    monkeypatch.setattr(distlock_admin, "LISTED_FROM",
                        (0, 0) if listed else (django.VERSION[0] + 1, 0))
    event = LockEvent.objects.get(kind="broken")
    heading = f"{event.name}: broken (token {event.token})"
    page = su_client.get(reverse("admin:distlock_lockevent_change", args=[event.pk]))
    assert crumbs(page) == ["Home", "Distributed locks", "Lock events", heading]
    history = su_client.get(reverse("admin:distlock_lockevent_history", args=[event.pk]))
    assert crumbs(history) == ["Home", "Distributed locks", "Lock events", heading, "History"]
    event_url = reverse("admin:distlock_lockevent_change", args=[event.pk])
    assert f'<a href="{event_url}">{heading}</a>' in history.content.decode()


def test_event_search_of_a_common_prefix_walks_time_back_on_sqlite(su_client, monkeypatch):
    """A prefix many events share is read newest first down ``at_us`` (SQLite read its
    whole name range and sorted it: 17 s at 10M events), a rare one through its range;
    both find exactly their events on every database."""
    from django.db import connection

    from distlock.admin import search as admin_search

    monkeypatch.setattr(admin_search, "COMMON", 50)
    LockEvent.objects.bulk_create(
        [LockEvent(at_us=i, kind=LockEvent.Kind.RENEWED, name=f"many:{i % 7}")
         for i in range(1, 61)]
        + [LockEvent(at_us=i, kind=LockEvent.Kind.RENEWED, name="few:1") for i in range(3)]
    )
    common = su_client.get(reverse(EVENTS), {"q": "many:", "kind": "all"})
    found = [e.at_us for e in common.context["cl"].result_list]
    assert found == list(range(60, 0, -1))
    rare = su_client.get(reverse(EVENTS), {"q": "few:", "kind": "all"})
    assert [e.at_us for e in rare.context["cl"].result_list] == [2, 1, 0]
    if connection.vendor != "sqlite":
        return  # PostgreSQL and MariaDB choose by their statistics
    assert "at_us" in _page_plan(common) and "distlock_event_name_at" not in _page_plan(common)
    assert "distlock_event_name_at" in _page_plan(rare)


@pytest.mark.parametrize(
    ("query", "expected"),
    [("ev:", {"ev:one": 2, "ev:two": 2}), ("ev:t", {"ev:two": 2}), ("=ev:one", {"ev:one": 2}),
     ("=ev:o", {}), ("EV:", {}), ("v:", {}), ("beta", {}), ("carol", {})],
)
def test_event_search_is_a_name_prefix(su_client, events, query, expected):
    """Names only, by prefix or ``=name``, through the (name, at_us) index: holder and who
    broke a lock have no index (a search of them read every event). (ev:one's renewal is
    hidden, as renewals are by default.)"""
    response = su_client.get(reverse(EVENTS), {"q": query})
    found = Counter(e.name for e in response.context["cl"].result_list)
    assert found == expected
    assert "Holder, owner and who broke a lock are not searched" in response.content.decode()


def test_event_search_covers_names_only_as_the_readme_says(su_client, events):
    """Issue 27 item 11: the README said the search covers holder, owner and who; it
    covers names. Decided: names only (no index serves the other three, and a search of
    them read every event), and the README says so, in the help text's words."""
    lease, other = events
    url = reverse(EVENTS)
    for term in (lease.owner, other.owner, lease.owner[:8], "alpha", "beta", "carol",
                 "=alpha"):
        assert list(su_client.get(url, {"q": term}).context["cl"].result_list) == [], term
    assert {e.name for e in su_client.get(url, {"q": "ev:"}).context["cl"].result_list} == {
        "ev:one", "ev:two"}
    # The admin's guide (docs/admin.md; it was the README's until the docs site).
    guide = (Path(__file__).resolve().parent.parent / "docs" / "admin.md").read_text()
    paragraph = " ".join(guide.split("**Lock events**", 1)[1].split("\n\n", 1)[0].split())
    assert "holder, owner and who" not in paragraph
    assert "search by the start of a lock name" in paragraph
    assert "Holder, owner and who broke a lock are not searched" in paragraph


def test_event_search_term_no_name_can_match_says_why(su_client, events):
    response = su_client.get(reverse(EVENTS), {"q": "x" * 300})
    assert list(response.context["cl"].result_list) == []
    [message] = messages_of(response)
    assert message.startswith("Nothing was searched: no lock name can match")


def test_event_admin_is_read_only(su_client, events):
    event = LockEvent.objects.first()
    change = reverse("admin:distlock_lockevent_change", args=[event.pk])
    response = su_client.get(change)
    assert response.status_code == 200 and 'name="_save"' not in response.content.decode()
    assert su_client.post(change, {"kind": "broken"}).status_code == 403
    assert su_client.get(reverse("admin:distlock_lockevent_add")).status_code == 403
    delete = reverse("admin:distlock_lockevent_delete", args=[event.pk])
    assert su_client.post(delete, {"post": "yes"}).status_code == 403
    response = su_client.post(
        reverse(EVENTS),
        {"action": "delete_selected", "_selected_action": [event.pk], "index": "0",
         "post": "yes"},
        follow=True,
    )
    assert LockEvent.objects.filter(pk=event.pk).exists()


def test_no_facet_counts_and_no_whole_table_count(su_client, three_locks):
    """Each would scan the whole table again on every page view (benchmarks/rows.py):
    facet counts once per filter choice, "(n total)" beside a filtered list."""
    response = su_client.get(reverse(CHANGELIST), {"_facets": "True", "state": "held"})
    html = response.content.decode()
    assert response.status_code == 200
    assert "job:held" in html and "job:free" not in html
    for state in ("held", "expired (not yet taken over)", "free"):
        assert f"{state} (1)" not in html
    assert "3 total" not in html
    response = su_client.get(reverse(EVENTS), {"_facets": "True"})
    assert response.status_code == 200


def test_atomic_requests_on_the_lock_database_is_reported_not_a_crash(su_client, monkeypatch):
    from django.db import connection

    lease = acquire("atomic", ttl=30)
    page = post_action(su_client, ["atomic"])
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    done = confirm(su_client, page)
    assert done.status_code == 200
    assert any("Nothing more was broken" in m and "DISTLOCK_DATABASE" in m
               for m in messages_of(done))
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", False)
    assert Lock.objects.get(name="atomic").owner == lease.owner


# --- how a lock was freed, the lock's page, its one history ------------------------


def test_free_locks_say_released_or_broken_from_the_audit(su_client, settings):
    settings.DISTLOCK_AUDIT = True
    acquire("freed:released", ttl=30).release()
    broken = acquire("freed:broken", ttl=30)
    break_lock("freed:broken", by="carol")
    # Taken again and released after the break: the row's freeing is the release now.
    again = acquire("freed:again", ttl=30)
    break_lock("freed:again", by="dave")
    acquire("freed:again", ttl=30).release()
    found = rows(su_client.get(reverse(CHANGELIST)))
    assert re.search(r">released (now|\d s ago)<", found["freed:released"])
    assert re.search(r'title="broken by carol">broken (now|\d s ago)<', found["freed:broken"])
    assert re.search(r">released (now|\d s ago)<", found["freed:again"])
    assert "broken" not in found["freed:again"]
    page = su_client.get(reverse("admin:distlock_lock_change", args=["freed:broken"]))
    # Said in the page, not only on hover, and never under "Expires".
    html = page.content.decode()
    assert re.search(r"broken (now|\d s ago) by carol — <time[^>]*>"
                     r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} ", html)
    assert "Expires:" not in html and "Freed:" in html
    assert broken.release() is False and again.release() is False


def test_lock_page_times_to_the_millisecond_in_the_site_time_zone(su_client, settings):
    settings.TIME_ZONE = "Asia/Kolkata"  # +05:30, so a UTC time would show
    lease = acquire("precise", ttl=30)
    lease.renew(ttl=30)
    html = su_client.get(reverse("admin:distlock_lock_change", args=["precise"])).content
    local = localtime(lease.acquired_at)
    assert local.utcoffset().total_seconds() == 5.5 * 3600
    stamp = f"{local:%Y-%m-%d %H:%M:%S}.{local.microsecond // 1000:03d} IST"
    assert stamp in html.decode()
    assert re.search(r"\(in (2\d|30) s\)", html.decode())


# A time as the audit stores it in a detail: UTC ISO 8601 with microseconds.
RAW_ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00")


def test_event_details_show_their_times_in_the_site_zone(su_client, settings):
    """Issue 34: a renewal's detail read "expires 2026-12-03T12:07:49.920824+00:00" on an
    IST site (a renewal at 17:37 IST "expired" at 12:07). The list, its tooltips and the
    event's page show it in the site's zone with the zone; the stored detail, the
    record, stays as the audit wrote it."""
    from distlock.times import expiry_in

    settings.TIME_ZONE = "Asia/Kolkata"
    settings.DISTLOCK_AUDIT = True
    lease = acquire("zone:detail", ttl=600)
    lease.renew(ttl=600)
    event = LockEvent.objects.get(name="zone:detail", kind="renewed")
    assert RAW_ISO.search(event.detail) and expiry_in(event.detail) is not None
    ends = localtime(from_us(expiry_in(event.detail)))
    second = f"{ends:%H:%M:%S} IST"
    exact = f"{ends:%Y-%m-%d %H:%M:%S}.{ends.microsecond // 1000:03d} IST"

    html = su_client.get(reverse(EVENTS), {"kind": "renewed"}).content.decode()
    cell = re.search(r'<td class="field-detail_cut"><span [^>]*title="([^"]*)">([^<]*)</span>',
                     html)
    # Today in IST by the database clock: the time of day, the zone after it.
    date = "" if ends.date() == localtime(from_us(db_now_us("default"))).date() \
        else f"{ends:%Y-%m-%d} "
    assert cell.group(2) == f"expires {date}{second}"
    assert cell.group(1) == f"expires {exact}"  # to the millisecond on hover
    assert re.search(r'field-at"[^>]*><a [^>]*><time [^>]*>[^<]* IST</time>', html)
    assert not RAW_ISO.search(html)

    page = su_client.get(reverse("admin:distlock_lockevent_change", args=[event.pk]))
    shown = field(page, "detail_shown")
    assert f"expires {exact}" in shown and not RAW_ISO.search(page.content.decode())
    assert re.search(r"\d\d:\d\d:\d\d\.\d{3} IST \((now|\d+ s ago)\)", field(page, "at_precise"))
    event.refresh_from_db()
    assert RAW_ISO.search(event.detail)  # the record is left as it was written


def test_details_keep_text_that_is_not_a_time():
    from distlock.admin.display import detail_html, detail_text

    now = 1_780_000_000_000_000
    for text in ("", "lock released", "row token 2026-13-45T99:99:99+00:00 is not a time",
                 "<b>held</b> by a & b"):
        assert detail_text(text, now) == text
    assert str(detail_html("<b>x</b>", now)) == "&lt;b&gt;x&lt;/b&gt;"


def test_the_break_page_shows_times_in_the_site_zone_with_how_soon(su_client, settings):
    """Issue 34: the confirmation said "in 10 min" with no time; its times are the
    database clock's, in the site's zone with the zone, and how soon beside them."""
    settings.TIME_ZONE = "Asia/Kolkata"
    lease = acquire("zone:break", ttl=600)
    page = post_action(su_client, ["zone:break"]).content.decode()
    table = re.search(r'<table id="distlock-break-list">.*?</table>', page, re.S).group(0)
    ends = localtime(lease.expires_at)
    assert re.search(rf"{ends:%H:%M:%S} IST</time> <span [^>]*>\(in (9|10) min\)</span>",
                     table), table
    begun = localtime(lease.acquired_at)
    assert f"{begun:%H:%M:%S} IST</time>" in table
    assert "time zone Asia/Kolkata" in page
    assert Lock.objects.get(name="zone:break").owner == lease.owner  # only shown


def break_button(response) -> str | None:
    html = response.content.decode()
    found = re.search(r'<form method="post" action="([^"]+)" class="distlock-break-form">'
                      r"(.*?)</form>", html, re.S)
    return None if found is None else found.group(0)


def test_break_button_on_a_held_lock_opens_the_confirmation(django_user_model):
    lease = acquire("button", ttl=30, holder="payer")
    operator = Client()
    operator.force_login(user_with(django_user_model, "operator", "view_lock", "break_lock"))
    page = operator.get(reverse("admin:distlock_lock_change", args=["button"]))
    form = break_button(page)
    assert form is not None and f'action="{reverse(CHANGELIST)}"' in form
    # What the button posts is the list's action for this one lock.
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', form))
    assert fields["action"] == "break_selected" and fields["_selected_action"] == "button"
    confirmation = operator.post(reverse(CHANGELIST), fields)
    assert "Break locks?" in confirmation.content.decode()
    assert lease.owner in confirmation.content.decode()
    assert Lock.objects.get(name="button").owner == lease.owner  # not before confirming
    confirm(operator, confirmation)
    assert Lock.objects.get(name="button").is_free
    # A free lock has no button.
    page = operator.get(reverse("admin:distlock_lock_change", args=["button"]))
    assert page.status_code == 200 and break_button(page) is None


def test_no_break_button_without_the_permission_and_its_post_is_refused(django_user_model):
    lease = acquire("no-button", ttl=30)
    viewer = Client()
    viewer.force_login(user_with(django_user_model, "viewer", "view_lock", "change_lock"))
    page = viewer.get(reverse("admin:distlock_lock_change", args=["no-button"]))
    assert page.status_code == 200 and lease.owner in page.content.decode()
    assert break_button(page) is None and "Break…" not in page.content.decode()
    forged = {"action": "break_selected", "index": "0", "_selected_action": "no-button"}
    done = viewer.post(reverse(CHANGELIST), forged, follow=True)
    assert messages_of(done) == ["No action selected."]
    assert Lock.objects.get(name="no-button").owner == lease.owner


def test_history_is_the_audit_with_audit_on(su_client, settings):
    settings.DISTLOCK_AUDIT = True
    acquire("story", ttl=30).release()
    history = reverse("admin:distlock_lock_history", args=["story"])
    response = su_client.get(history)
    assert response.status_code == 302
    assert response["Location"] == f"{reverse(EVENTS)}?name__exact=story"
    events = su_client.get(response["Location"]).context["cl"].result_list
    assert {event.kind for event in events} == {"acquired", "released"}


def test_history_is_django_log_with_audit_off(su_client):
    lease = acquire("quiet", ttl=30)
    confirm(su_client, post_action(su_client, ["quiet"]))
    entry = LogEntry.objects.get(object_id="quiet")
    assert str(lease.token) in entry.get_change_message()
    assert not LockEvent.objects.exists()
    response = su_client.get(reverse("admin:distlock_lock_history", args=["quiet"]))
    assert response.status_code == 200
    assert f"Broke the lock (token {lease.token}" in response.content.decode()


def test_history_of_a_missing_lock_or_without_permission(su_client, settings, django_user_model):
    settings.DISTLOCK_AUDIT = True
    missing = su_client.get(reverse("admin:distlock_lock_history", args=["nope"]), follow=True)
    assert missing.status_code == 200
    assert any("doesn’t exist" in m for m in messages_of(missing))
    acquire("secret", ttl=30).release()
    nobody = Client()
    nobody.force_login(user_with(django_user_model, "nobody"))
    assert nobody.get(reverse("admin:distlock_lock_history", args=["secret"])).status_code == 403


def test_a_long_history_is_counted_only_up_to_a_cap(su_client, settings, monkeypatch):
    """Counting 10M events costs a second per page view: the count stops at a cap."""
    from distlock.admin.paging import CappedPaginator

    settings.DISTLOCK_AUDIT = True
    monkeypatch.setattr(CappedPaginator, "CAP", 3)
    for _ in range(3):
        acquire("many", ttl=30).release()  # 6 events
    response = su_client.get(reverse(EVENTS))
    assert response.context["cl"].result_count == 4  # CAP + 1: "more than"
    assert len(response.context["cl"].result_list) == 6
    assert 'id="distlock-count-capped"' in response.content.decode()
    assert "more than 3 lock events" in response.content.decode()
    few = su_client.get(reverse(EVENTS), {"kind": "acquired", "q": "many"})
    assert few.context["cl"].result_count == 3
    assert "3 lock events" in few.content.decode() and "more than" not in few.content.decode()


def test_the_lock_list_counts_up_to_the_cap_too(su_client, monkeypatch):
    from distlock.admin.paging import CappedPaginator

    monkeypatch.setattr(CappedPaginator, "CAP", 2)
    for n in range(4):
        acquire(f"row:{n}", ttl=30).release()
    response = su_client.get(reverse(CHANGELIST))
    assert response.context["cl"].result_count == 3
    assert "more than 2 locks" in response.content.decode()
    assert result_names(response) == [f"row:{n}" for n in range(4)]


@pytest.mark.parametrize(
    ("prefix", "end"),
    [("inv:", "inv;"), ("a", "b"), ("\ud7ff", "\ue000"), ("z\U0010ffff", "{"),
     ("\U0010ffff\U0010ffff", None), ("é", "ê")],
)
def test_prefix_end_is_the_first_string_past_the_prefix(prefix, end):
    assert prefix_end(prefix) == end


def test_names_are_in_code_point_order_on_the_test_databases(lock_db):
    # The search's index range needs it; the test databases have it (PostgreSQL's is
    # C.UTF-8, MariaDB's column utf8mb4_nopad_bin, SQLite's BINARY).
    from django.db import connections

    from distlock.backends import backend_for

    connection = connections[lock_db]
    assert backend_for(connection).names_in_code_point_order(connection)


# --- the Locks list's holder and held-by lookup, the lock page (issue 34) ---------------

LOCK_PAGE = "admin:distlock_lock_change"


def field(response, name: str) -> str:
    """The text of one read-only field of a lock's page, tags dropped."""
    html = response.content.decode()
    found = re.search(rf'class="form-row field-{name}">.*?<div class="readonly">(.*?)</div>',
                      html, re.S)
    assert found is not None, f"no field {name}"
    return unescape(re.sub(r"<[^>]+>", "", found.group(1)))


def test_the_holder_shows_its_end_the_part_that_names_the_worker(su_client):
    long = "task=celery-worker-7@node-12 job=invoice:nightly-rebuild attempt=3 worker-END"
    lease = acquire("holder:long", ttl=30, holder=long)
    acquire("holder:short", ttl=30, holder="w1")
    found = rows(su_client.get(reverse(CHANGELIST)))
    cell = re.search(r'field-holder_cut">(.*?)</td>', found["holder:long"]).group(1)
    shown = unescape(re.search(r'class="[^"]*distlock-holder"[^>]*>([^<]*)<', cell).group(1))
    whole = Lock.objects.get(name="holder:long").holder
    assert whole.endswith("worker-END") and len(whole) > 60
    # The middle elided: the start (host) and the end (the worker) stay; all on hover.
    assert shown.endswith("attempt=3 worker-END") and "…" in shown
    assert shown.startswith(whole[:10]) and len(shown) < len(whole)
    assert f'title="{whole}"' in cell
    # A holder that fits two lines is shown whole.
    short = Lock.objects.get(name="holder:short").holder
    assert f">{short}</span>" in found["holder:short"]
    assert lease.owner[:8] in cell


def test_held_by_finds_the_locks_a_worker_holds(su_client):
    acquire("job:a1", ttl=30, holder="worker-A")
    acquire("job:a2", ttl=30, holder="worker-A")
    acquire("job:b1", ttl=30, holder="worker-B")
    expired_lock("job:a-expired", holder="worker-A")  # still its: not taken over
    acquire("job:a-released", ttl=30, holder="worker-A").release()  # free: nobody's
    found = su_client.get(reverse(CHANGELIST), {"holder": "worker-a"})  # any case
    assert sorted(result_names(found)) == ["job:a-expired", "job:a1", "job:a2"]
    html = found.content.decode()
    assert 'value="worker-a"' in html  # the box keeps the term
    assert 'id="distlock-search-hint"' not in html
    assert result_names(su_client.get(reverse(CHANGELIST), {"holder": "worker-B"})) == [
        "job:b1"]


def test_a_search_that_finds_nothing_says_what_it_looks_at(su_client):
    acquire("job:a1", ttl=30, holder="worker-A")
    searched = su_client.get(reverse(CHANGELIST), {"q": "worker-A"})
    assert result_names(searched) == []
    hint = re.search(r'id="distlock-search-hint">(.*?)</p>', searched.content.decode(), re.S)
    assert hint is not None
    text = unescape(hint.group(1))
    assert "the search looks at lock names only" in text
    link = re.search(r'href="([^"]+)" id="distlock-held-by-suggestion"', text).group(1)
    assert link == "?holder=worker-A"
    assert result_names(su_client.get(reverse(CHANGELIST) + link)) == ["job:a1"]

    nobody = su_client.get(reverse(CHANGELIST), {"holder": "worker-Z"})
    assert result_names(nobody) == []
    assert "No held or expired lock has a holder containing “worker-Z”" in unescape(
        nobody.content.decode())
    # A search that finds something says nothing more.
    found = su_client.get(reverse(CHANGELIST), {"q": "job:"})
    assert result_names(found) == ["job:a1"]
    assert 'id="distlock-search-hint"' not in found.content.decode()


def test_the_lock_page_answers_everything_about_one_lock(su_client, settings):
    settings.DISTLOCK_AUDIT = True
    expired_lock("page:lock", holder="old-worker")
    lease = acquire("page:lock", ttl=600, holder="worker-7")  # a take-over
    lease.renew(ttl=600)
    record("stale_write", name="page:lock", using="default", token=lease.token - 1)
    record("stale_write", name="page:lock", using="default", token=lease.token - 1)
    break_lock("page:lock", by="carol")
    lease = acquire("page:lock", ttl=600, holder="worker-8")
    lease.renew(ttl=600)
    acquire("page:other", ttl=30).release()  # another lock's events are not counted
    page = su_client.get(reverse(LOCK_PAGE, args=["page:lock"]))
    assert re.fullmatch(r"\d+ s \(since acquired, by the database clock\)",
                        field(page, "held_for"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \S+ \((now|\d s ago)\), "
                        r"1 renewal", field(page, "renewed_at"))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \S+ \(in (9|10) min\)",
                        field(page, "expires_at"))
    # 3 grants: the first, the take-over, the one after the break.
    assert field(page, "last_hour") == "3 grants (1 take-over), 2 stale writes refused"
    assert re.fullmatch(r"by carol, \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \S+ "
                        r"\((now|\d s ago)\) \(token 2\)", field(page, "broken_by"))
    waiting = field(page, "waiters")
    if connection.vendor == "postgresql":
        assert waiting == "nobody is waiting"
    else:
        assert waiting.startswith("not known here")
    html = page.content.decode()
    assert f'href="{reverse(EVENTS)}?name__exact=page%3Alock"' in html
    timeline = reverse("admin:distlock_lock_timeline") + "?name=page%3Alock"
    assert f'id="distlock-timeline-link" href="{timeline}"' in html


def test_the_lock_page_shows_the_lease_policies_in_force(su_client):
    """Issue 30: a grant's policies, each with the moment it sets; a lock-delay with both
    ends (the holder's lease and the row's), also after a break."""
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \S+ \((in \d+ s|in \d+ min|now|\d s ago)\)"
    lease = acquire("page:policies", ttl=600, min_hold=5, max_hold=900, lock_delay=2)
    page = su_client.get(reverse(LOCK_PAGE, args=["page:policies"]))
    text = field(page, "lease_policies")
    assert re.fullmatch(
        rf"min_hold 5s: a release before {stamp} keeps it until then; "
        rf"max_hold 900s: no renewal past {stamp}; "
        rf"lock_delay 2s: the lease ends ({stamp}), the row ({stamp}) "
        r"\(nobody else is granted it before\)", text), text
    row = Lock.objects.get(name="page:policies")
    lease_end = localtime(from_us(row.expires_us - 2_000_000)).strftime("%H:%M:%S.%f")[:-3]
    row_end = localtime(from_us(row.expires_us)).strftime("%H:%M:%S.%f")[:-3]
    assert lease_end in text and row_end in text and lease_end != row_end
    assert break_lock("page:policies") is True
    page = su_client.get(reverse(LOCK_PAGE, args=["page:policies"]))
    assert re.fullmatch(
        rf"lock_delay 2s: the broken lease ended {stamp}, the row {stamp} "
        r"\(nobody else is granted it before\)", field(page, "lease_policies"))
    acquire("page:nopolicy", ttl=30)
    page = su_client.get(reverse(LOCK_PAGE, args=["page:nopolicy"]))
    assert field(page, "lease_policies") == "none"
    assert lease.release() is False


def test_a_lock_never_broken_or_renewed_says_so(su_client, settings):
    settings.DISTLOCK_AUDIT = True
    acquire("page:calm", ttl=30)
    page = su_client.get(reverse(LOCK_PAGE, args=["page:calm"]))
    assert field(page, "renewed_at") == "never renewed"
    assert field(page, "broken_by") == "never (as far as the audit history goes)"
    assert field(page, "last_hour") == "1 grant (0 take-overs), 0 stale writes refused"


def test_an_expired_lock_page_says_it_ran_out(su_client):
    expired_lock("page:expired")
    page = su_client.get(reverse(LOCK_PAGE, args=["page:expired"]))
    assert re.fullmatch(r"ran out \d{4}-\S+ \d\d:\d\d:\d\d\.\d{3} \S+ \((now|\d+ s ago)\) — "
                        r"nobody took it over; the next acquire will",
                        field(page, "expires_at"))
    assert "the lease ran out" in field(page, "held_for")


@pytest.mark.no_pooler("a waiter's session advisory lock")
@pytest.mark.skipif("connection.vendor != 'postgresql'",
                    reason="waiters register (pg_locks) on PostgreSQL only")
def test_the_lock_page_counts_who_waits_on_postgresql(su_client):
    from distlock import lock_status
    from tests.support.helpers import start_thread, wait_until

    holder = acquire("page:wanted", ttl=60)
    granted = []
    waiter = start_thread(lambda: granted.append(acquire("page:wanted", ttl=30, timeout=30)))
    try:
        wait_until(lambda: lock_status("page:wanted").waiters == 1, 10, "the waiter registers")
        page = su_client.get(reverse(LOCK_PAGE, args=["page:wanted"]))
        assert field(page, "waiters").startswith("1 session waits")
    finally:
        holder.release()
        waiter.join(30)
    assert granted
    granted[0].release()


def test_breaking_from_the_lock_page_returns_to_it(django_user_model, settings):
    settings.DISTLOCK_AUDIT = True
    acquire("page:break", ttl=30, holder="payer")
    operator = Client()
    operator.force_login(user_with(django_user_model, "operator", "view_lock", "break_lock"))
    here = reverse(LOCK_PAGE, args=[quote("page:break")])
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"',
                             break_button(operator.get(here))))
    confirmation = operator.post(reverse(CHANGELIST), fields)
    assert f'href="{here}" class="button cancel-link"' in confirmation.content.decode()
    done = confirm(operator, confirmation, follow=False)
    assert done.status_code == 302 and done["Location"] == here
    page = operator.get(here)
    assert any("Broke 1 lock(s): page:break" in m for m in messages_of(page))
    assert re.fullmatch(r"broken (now|\d s ago) by operator \(admin\) — .*",
                        field(page, "freed_at"))
    assert "Expires:" not in page.content.decode()
    # From the list, the list it stays.
    acquire("page:break", ttl=30)
    done = confirm(operator, post_action(operator, ["page:break"]), follow=False)
    assert done["Location"] == reverse(CHANGELIST)


def test_times_carry_the_site_zone_with_a_relative_time(su_client):
    from django.test import override_settings

    lease = acquire("zone:held", ttl=240, holder="w")
    lease.renew(ttl=240)
    with override_settings(TIME_ZONE="Asia/Kolkata"):
        listed = su_client.get(reverse(CHANGELIST)).content.decode()
        page = su_client.get(reverse(LOCK_PAGE, args=["zone:held"]))
    local = localtime(lease.expires_at, timezone=ZoneInfo("Asia/Kolkata"))
    times = re.findall(r"<time[^>]*>([^<]*)</time>", listed)
    assert times and all(text.endswith(" IST") for text in times), times
    row = rows_of_html(listed)["zone:held"]
    # The date comes first when the expiry falls on another day there than the database
    # clock's now (a run near midnight IST, 18:30 UTC).
    assert re.search(rf'>(?:{local:%Y-%m-%d} )?{local:%H:%M:%S} IST</time>'
                     r'<span class="distlock-relative">in [34] min</span>', row), row
    stamp = f"{local:%Y-%m-%d %H:%M:%S}.{local.microsecond // 1000:03d} IST"
    assert re.fullmatch(rf"{re.escape(stamp)} \(in [34] min\)", field(page, "expires_at"))
    shown = re.findall(r"<time[^>]*>([^<]*)</time>", page.content.decode())
    assert len(shown) >= 3 and all(text.endswith(" IST") for text in shown), shown


def rows_of_html(html: str) -> dict[str, str]:
    class _Response:
        content = html.encode()

    return rows(_Response())


def test_an_elections_lock_shows_its_term_and_the_list_filters_the_leaders(su_client):
    """Issue 30: the admin shows leaders — the term (the token) and since when, by the
    database clock — and "elections" lists the elections' locks only."""
    from distlock.leader import elect

    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \S+ \((in \d+ s|now|\d+ s ago)\)"
    term = elect("el:scheduler", ttl=600, holder="beat on host-3")
    assert term is not None
    acquire("el:plain", ttl=600, holder="not a leader")
    try:
        row = Lock.objects.get(name="el:scheduler")
        assert "[leader] beat on host-3" in row.holder
        page = su_client.get(reverse(LOCK_PAGE, args=["el:scheduler"]))
        assert re.fullmatch(rf"term {term.token}, leading since {stamp}",
                            field(page, "leader_term")), field(page, "leader_term")
        plain = su_client.get(reverse(LOCK_PAGE, args=["el:plain"]))
        assert "field-leader_term" not in plain.content.decode()
        assert result_names(su_client.get(reverse(CHANGELIST), {"leader": "yes"})) == [
            "el:scheduler"]
    finally:
        term.resign()
    assert result_names(su_client.get(reverse(CHANGELIST), {"leader": "yes"})) == []
