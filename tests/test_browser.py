"""The admin in a real browser: headless Chromium driven by Playwright against the live
server. Log in, see a held lock, break it through the confirmation page, see it free and
the event recorded. Screenshots go to artifacts/browser/<backend>/.

Needs Debian's ``chromium`` package (``apt-get install -y chromium``) and the ``playwright``
Python package (the dev extra); Playwright's own browser downloads are never used. Without
them the test is skipped with the reason, unless DISTLOCK_REQUIRE_BROWSER=1 (CI), which
turns the skip into a failure.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client

from distlock import LockLost, StaleToken, acquire
from distlock.models import Lock, LockEvent
from distlock.ops.audit import record
from tests.support.browser import (
    ARGS,
    CHROMIUM,
    TIMEOUT_MS,
    BrowserThread,
    browser_or_skip,
    in_thread,
)
from tests.support.helpers import expired_lock


@pytest.fixture
def shots(request) -> Path:
    folder = Path(settings.BASE_DIR) / "artifacts" / "browser" / connection.vendor
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    return folder


def test_break_a_lock_in_the_browser(live_server, django_user_model, settings, shots):
    """The whole break, login included, in a browser of its own."""
    sync_api = browser_or_skip()
    settings.DISTLOCK_AUDIT = True
    django_user_model.objects.create_superuser("ops", "ops@example.com", "s3cret-pw")
    lease = acquire("report:browser", ttl=600, holder="nightly-report")
    acquire("report:idle", ttl=30).release()

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            expect = sync_api.expect

            page.goto(f"{live_server.url}/admin/distlock/lock/")
            expect(page).to_have_url(re.compile(r"/admin/login/"))
            page.fill("#id_username", "ops")
            page.fill("#id_password", "s3cret-pw")
            page.click("input[type=submit]")
            expect(page).to_have_url(re.compile(r"/admin/distlock/lock/$"))

            row = page.locator("#result_list tbody tr", has_text="report:browser")
            expect(row.locator(".distlock-held")).to_have_text("held")
            expect(row.locator(".field-holder_cut")).to_contain_text("nightly-report")
            expect(row.locator(".field-token")).to_have_text(str(lease.token))
            expect(row.locator(".field-expires .distlock-relative")).to_have_text(
                re.compile(r"^in (9|10) min$"))
            idle = page.locator("#result_list tbody tr", has_text="report:idle")
            expect(idle.locator(".distlock-free")).to_have_text("free")
            page.screenshot(path=str(shots / "01-locks-held.png"), full_page=True)

            row.locator("input.action-select").check()
            page.select_option("select[name=action]", "break_selected")
            page.click("button[name=index]")
            expect(page.locator("h1")).to_have_text("Break locks?")
            expect(page.locator("#distlock-break-list")).to_contain_text(lease.owner)
            expect(page.locator("#distlock-break-list")).to_contain_text(str(lease.token))
            page.screenshot(path=str(shots / "02-confirmation.png"), full_page=True)
            assert in_thread(lambda: Lock.objects.get(name="report:browser").owner) == lease.owner

            page.click("#distlock-confirm-break")
            expect(page.locator("ul.messagelist")).to_contain_text(
                "Broke 1 lock(s): report:browser"
            )
            row = page.locator("#result_list tbody tr", has_text="report:browser")
            expect(row.locator(".distlock-free")).to_have_text("free")
            expect(row.locator(".field-expires")).to_have_text(re.compile(r"^broken "))
            page.screenshot(path=str(shots / "03-broken.png"), full_page=True)

            page.goto(f"{live_server.url}/admin/distlock/lockevent/?kind=broken")
            event = page.locator("#result_list tbody tr", has_text="report:browser")
            expect(event.locator(".distlock-broken")).to_have_text("broken")
            expect(event.locator(".field-detail_cut")).to_have_text("by ops (admin)")
            page.screenshot(path=str(shots / "04-event.png"), full_page=True)
        finally:
            browser.close()

    assert Lock.objects.get(name="report:browser").is_free
    assert LockEvent.objects.filter(name="report:browser", kind="broken", by="ops (admin)")
    with pytest.raises(LockLost):
        lease.renew()
    assert acquire("report:browser", ttl=30).token == lease.token + 1
    assert sorted(p.name for p in shots.glob("*.png")) == [
        "01-locks-held.png", "02-confirmation.png", "03-broken.png", "04-event.png",
    ]


def _login(page, url: str, expect) -> None:
    page.goto(url)
    page.fill("#id_username", "ops")
    page.fill("#id_password", "s3cret-pw")
    page.click("input[type=submit]")
    expect(page.locator("#distlock-timeline svg.distlock-timeline")).to_be_visible()


_PICTURE = """svg => {
    const bars = [...svg.querySelectorAll("g.dl-bar[data-token]")].map(g => ({
        token: g.dataset.token, ended: g.dataset.ended,
        x: g.querySelector("rect").getBBox().x}));
    const marks = kind => [...svg.querySelectorAll(`g[data-kind="${kind}"]`)].map(g => {
        const shape = g.querySelector("circle, path, line");
        const box = shape.getBBox();
        return {token: g.dataset.token, x: box.x + box.width / 2,
                fill: getComputedStyle(shape).fill};
    });
    const label = svg.querySelector("g[data-lane] text");
    return {bars, took_over: marks("took_over"), stale: marks("stale_write"),
            label: getComputedStyle(label).fill,
            page: getComputedStyle(document.body).color,
            width: svg.getBoundingClientRect().width,
            box: svg.parentElement.getBoundingClientRect().width};
}"""


@pytest.mark.processes
def test_timeline_of_a_paused_holder_taken_over_and_refused(
    live_server, django_user_model, children
):
    """The seed's story with real processes, then drawn: A is granted, SIGSTOPped past its
    lease, B takes over and writes, A wakes and its fenced write is refused. The lock's
    admin page must show A's bar, then B's with a take-over mark, and a red stale-write
    mark after B's bar began — in the light and the dark theme."""
    import signal
    import time

    from tests.factories import AccountFactory
    from tests.test_fencing import pause_until

    sync_api = browser_or_skip()
    # Beside the other test's screenshots, not among them (its fixture clears its folder).
    shots = Path(settings.BASE_DIR) / "artifacts" / "browser" / connection.vendor / "timeline"
    shots.mkdir(parents=True, exist_ok=True)
    django_user_model.objects.create_superuser("ops", "ops@example.com", "s3cret-pw")
    account = AccountFactory(note="initial")
    worker = "tests.support.fencing_workers:audited_writer"
    a = children.start(worker, "testapp.Account", account.pk, 1.0)
    lease_a = a.expect("acquired")
    a.signal(signal.SIGSTOP)
    resume_at = time.monotonic() + 2.0
    b = children.start(worker, "testapp.Account", account.pk, 600.0)
    lease_b = b.expect("acquired")
    b.send("write", note="B")
    b.expect("wrote")
    pause_until(resume_at)
    a.signal(signal.SIGCONT)
    a.send("write", note="A")
    a.expect("refused")
    for child in (a, b):
        child.send("exit")
        assert child.finish() == 0
    assert lease_b["token"] == lease_a["token"] + 1
    kinds = list(LockEvent.objects.filter(name=f"account:{account.pk}")
                 .order_by("at_us", "id").values_list("kind", flat=True))
    assert kinds[:2] == ["acquired", "took_over"] and "stale_write" in kinds

    url = f"{live_server.url}/admin/distlock/lock/account:{account.pk}/change/"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            _login(page, url, sync_api.expect)
            drawn = {}
            for theme in ("light", "dark"):
                page.emulate_media(color_scheme=theme)
                svg = page.locator("#distlock-timeline svg.distlock-timeline")
                drawn[theme] = svg.evaluate(_PICTURE)
                page.locator("#distlock-timeline").screenshot(
                    path=str(shots / f"timeline-{theme}.png"))
        finally:
            browser.close()

    for theme, got in drawn.items():
        bars = got["bars"]
        assert [bar["token"] for bar in bars] == [str(lease_a["token"]), str(lease_b["token"])]
        assert bars[0]["x"] < bars[1]["x"] and bars[0]["ended"] == "expired"
        assert bars[1]["ended"] == "held"  # B still holds it (600 s lease)
        (took_over,) = got["took_over"]
        assert took_over["token"] == str(lease_b["token"])
        assert got["stale"], "no stale-write mark"
        for stale in got["stale"]:
            assert stale["token"] == str(lease_a["token"])
            assert stale["x"] > bars[1]["x"]  # after B's bar began
            assert stale["fill"] == "rgb(224, 49, 49)"  # red
        # Text takes the theme's colour (not a fixed black), and the picture fits its box.
        assert got["label"] == got["page"], theme
        assert got["width"] <= got["box"] + 0.5
    assert drawn["light"]["label"] != drawn["dark"]["label"]


# --- the admin at 1366 x 900: one browser for the tests below ----------------------------

VIEWPORT = {"width": 1366, "height": 900}
LONG_HOLDER = (
    "reporting-worker-7.eu-west-1.compute.internal pid 4182 thread ThreadPoolExecutor-0_3 "
    "task reports.tasks.render_monthly_statement[9f1c2a]"
)
LONG_NAME = "report:customer-000042:2026-12:monthly-statement-with-attachments"
LONG_DETAIL = "shop.Account: write with token 41 refused (row token 42); " + "x" * 300


@pytest.fixture(scope="module")
def chromium() -> Iterator[BrowserThread]:
    thread = BrowserThread(browser_or_skip())
    yield thread
    thread.close()


@pytest.fixture
def admin_shots() -> Path:
    folder = Path(settings.BASE_DIR) / "artifacts" / "browser" / connection.vendor / "admin"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def open_as(
    chromium: BrowserThread, user: Any, url: str, *, dark: bool = False,
    viewport: dict[str, int] | None = None,
) -> Any:
    """A fresh page at 1366 x 900 (or ``viewport``), logged in as ``user`` by its session
    cookie (no login form: the form is the other test's business and costs a page load)."""
    client = Client()
    client.force_login(user)
    cookie = client.cookies[settings.SESSION_COOKIE_NAME].value

    def work(browser: Any, sync_api: Any) -> Any:
        context = browser.new_context(
            viewport=viewport or VIEWPORT, color_scheme="dark" if dark else "light"
        )
        # For the whole site: a cookie set by a page's URL is sent below its path only.
        site = "/".join(url.split("/")[:3]) + "/"
        context.add_cookies([{"name": settings.SESSION_COOKIE_NAME, "value": cookie,
                              "url": site}])
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(url)
        return page

    return chromium.run(work)


def close(chromium: BrowserThread, page: Any) -> None:
    chromium.run(lambda browser, api: page.context.close())


FIT = """() => {
    const doc = document.documentElement;
    const table = document.querySelector("#result_list");
    const box = table.closest(".results");
    const headers = {};
    for (const th of table.querySelectorAll("thead th")) {
        const r = th.getBoundingClientRect();
        headers[th.innerText.trim().toLowerCase()] = {
            left: r.left, right: r.right, cut: th.scrollWidth > th.clientWidth + 1,
        };
    }
    return {
        docScroll: doc.scrollWidth, docClient: doc.clientWidth,
        boxScroll: box.scrollWidth, boxClient: box.clientWidth,
        tableRight: table.getBoundingClientRect().right,
        boxRight: box.getBoundingClientRect().right,
        viewport: window.innerWidth, headers,
    };
}"""


def assert_fits(got: dict[str, Any], columns: list[str]) -> None:
    assert got["docScroll"] <= got["docClient"], got
    assert got["boxScroll"] <= got["boxClient"], got
    assert got["tableRight"] <= got["boxRight"] + 1, got
    for column in columns:
        header = got["headers"][column]
        assert header["left"] >= 0 and header["right"] <= got["viewport"], (column, got)
        assert not header["cut"], (column, got)


@pytest.fixture
def long_values(lock_db, settings) -> dict[str, Any]:
    """Locks and events with the longest text a site is likely to show."""
    settings.DISTLOCK_AUDIT = True
    held = acquire(LONG_NAME, ttl=3600, holder=LONG_HOLDER)
    held.renew(ttl=3600)
    acquire("job:short", ttl=30, holder="w").release()
    record("stale_write", name=LONG_NAME, using="default", token=held.token,
           owner=held.owner, holder=LONG_HOLDER, detail=LONG_DETAIL)
    return {"held": held}


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
def test_lists_fit_1366_without_horizontal_scrolling(
    chromium, live_server, admin_user, long_values, admin_shots, dark
):
    theme = "dark" if dark else "light"
    page = open_as(chromium, admin_user, f"{live_server.url}/admin/distlock/lock/", dark=dark)
    try:
        def locks(browser: Any, api: Any) -> dict[str, Any]:
            row = page.locator("#result_list tbody tr", has_text="monthly-statement")
            api.expect(row.locator(".distlock-held")).to_have_text("held")
            holder = row.locator(".field-holder_cut .distlock-cut")
            api.expect(holder).to_have_attribute("title", long_values["held"].holder)
            api.expect(row.locator(".distlock-owner")).to_have_attribute(
                "title", long_values["held"].owner)
            api.expect(row.locator(".field-expires .distlock-relative")).to_have_text(
                re.compile(r"^in (59 min|1 h)$"))
            api.expect(row.locator(".field-renewed")).to_contain_text("once")
            api.expect(page.locator("th.column-renewed")).to_be_visible()
            page.screenshot(path=str(admin_shots / f"locks-1366-{theme}.png"))
            return page.evaluate(FIT)

        assert_fits(chromium.run(locks), ["name", "holder", "expires", "renewed"])

        def events(browser: Any, api: Any) -> dict[str, Any]:
            page.goto(f"{live_server.url}/admin/distlock/lockevent/")
            row = page.locator("#result_list tbody tr", has_text="stale write refused")
            detail = row.locator(".field-detail_cut .distlock-cut")
            api.expect(detail).to_be_visible()
            api.expect(detail).to_have_attribute("title", LONG_DETAIL)
            api.expect(page.locator("th.column-detail_cut")).to_be_visible()
            page.screenshot(path=str(admin_shots / f"events-1366-{theme}.png"))
            return page.evaluate(FIT)

        assert_fits(chromium.run(events), ["at", "event", "name", "holder", "detail"])
    finally:
        close(chromium, page)


def test_overview_refreshes_without_navigation(
    chromium, live_server, admin_user, lock_db, settings, admin_shots
):
    settings.DISTLOCK_AUDIT = True
    acquire("overview:first", ttl=600, holder="first-holder")
    # Every second (?refresh=1) rather than the default 5 s: the test waits for a refresh.
    url = f"{live_server.url}/admin/distlock/lock/overview/?refresh=1"
    page = open_as(chromium, admin_user, url)
    try:
        def loaded(browser: Any, api: Any) -> int:
            api.expect(page.locator("#distlock-held")).to_contain_text("overview:first")
            api.expect(page.locator("#distlock-held-count")).to_have_text("1")
            page.evaluate("() => { window.distlockFirstLoad = true; }")
            return int(page.locator("#distlock-overview").get_attribute("data-refreshes"))

        before = chromium.run(loaded)
        later = acquire("overview:later", ttl=600, holder="later-holder")
        record("stale_write", name="overview:first", using="default", token=1,
               detail="shop.Account: write with token 1 refused (row token 2)")

        def refreshed(browser: Any, api: Any) -> bool:
            # Waits (with the page's timeout) for the refresh to bring the new lock.
            api.expect(page.locator("#distlock-held")).to_contain_text("overview:later")
            api.expect(page.locator("#distlock-held-count")).to_have_text("2")
            api.expect(page.locator("#distlock-stale-count")).to_have_text("1")
            page.screenshot(path=str(admin_shots / "overview-1366-light.png"), full_page=True)
            page.emulate_media(color_scheme="dark")
            page.screenshot(path=str(admin_shots / "overview-1366-dark.png"), full_page=True)
            return bool(page.evaluate("() => window.distlockFirstLoad === true"))

        assert chromium.run(refreshed), "the page was reloaded, not refreshed in place"
        assert int(chromium.run(
            lambda b, a: page.locator("#distlock-overview").get_attribute("data-refreshes")
        )) > before
        assert later.release() is True
    finally:
        close(chromium, page)


OVERVIEW_STATUS = "#distlock-overview-status"


def test_overview_says_signed_out_when_the_session_ends(
    chromium, live_server, admin_user, lock_db, settings, admin_shots
):
    """Issue 34: after a logout elsewhere the refresh put the whole login page inside the
    panel and the status line still said "Refreshed"."""
    settings.DISTLOCK_AUDIT = True
    settings.TIME_ZONE = "Asia/Kolkata"
    acquire("overview:signed-out", ttl=600, holder="still-here")
    url = f"{live_server.url}/admin/distlock/lock/overview/?refresh=1"
    page = open_as(chromium, admin_user, url)
    try:
        def refreshed_once(browser: Any, api: Any) -> str:
            status = page.locator(OVERVIEW_STATUS)
            api.expect(status).to_have_attribute("data-state", "refreshed")
            # The database clock's time in the site's zone, never the browser's clock.
            api.expect(status).to_have_text(re.compile(
                r"^Refreshed every 1 s; last at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} IST\.$"))
            return str(page.locator("#distlock-overview").get_attribute("data-refreshes"))

        chromium.run(refreshed_once)

        def signed_out(browser: Any, api: Any) -> dict[str, Any]:
            # The session ends elsewhere: its cookie is gone, as after a logout in
            # another tab (the next fetch is redirected to the login page).
            page.context.clear_cookies()
            status = page.locator(OVERVIEW_STATUS)
            api.expect(status).to_have_attribute("data-state", "signed-out")
            api.expect(status).to_have_text("Signed out — reload to sign in.")
            page.screenshot(path=str(admin_shots / "overview-signed-out.png"))
            return page.evaluate("""() => ({
                status: document.querySelector("#distlock-overview-status").textContent,
                login: document.querySelectorAll(
                    "#distlock-overview form, #distlock-overview #id_username").length,
                panel: document.querySelector("#distlock-overview").textContent,
                refreshes: document.querySelector("#distlock-overview").dataset.refreshes,
            })""")

        got = chromium.run(signed_out)
        assert "Refreshed" not in got["status"], got["status"]
        assert got["login"] == 0, "the login page was put inside the panel"
        assert "overview:signed-out" in got["panel"]  # the last refresh's content stays

        def still_signed_out(browser: Any, api: Any) -> str:
            # The next attempts (every 1 s) are refused the same way: wait, with the
            # page's deadline, for two more to finish.
            checks = int(page.locator("#distlock-overview").get_attribute("data-checks"))
            page.wait_for_function(
                f"() => Number(document.querySelector('#distlock-overview')"
                f".dataset.checks) >= {checks + 2}")
            return str(page.locator(OVERVIEW_STATUS).text_content())

        assert chromium.run(still_signed_out) == "Signed out — reload to sign in."
        assert chromium.run(lambda b, a: page.locator("#distlock-overview").get_attribute(
            "data-refreshes")) == got["refreshes"]
    finally:
        close(chromium, page)


SUMMARY_BOX = """() => {
    const items = [...document.querySelectorAll("#distlock-summary .distlock-summary-item")];
    return {
        scrollY: window.scrollY, width: window.innerWidth, height: window.innerHeight,
        docScroll: document.documentElement.scrollWidth,
        items: items.map(li => {
            const r = li.getBoundingClientRect();
            return {id: li.id, top: r.top, bottom: r.bottom, left: r.left, right: r.right,
                    text: li.innerText};
        }),
    };
}"""


def test_overview_summary_row_is_inside_the_first_viewport_at_1366(
    chromium, live_server, admin_user, long_values, admin_shots
):
    expired_lock("overview:expired", holder=LONG_HOLDER)
    url = f"{live_server.url}/admin/distlock/lock/overview/"
    page = open_as(chromium, admin_user, url)
    try:
        def measure(browser: Any, api: Any) -> dict[str, Any]:
            api.expect(page.locator("#distlock-summary-expired .distlock-figure")).to_have_text(
                "1")
            api.expect(page.locator("#distlock-expired")).to_contain_text("overview:expired")
            page.screenshot(path=str(admin_shots / "overview-summary-1366.png"))
            return page.evaluate(SUMMARY_BOX)

        got = chromium.run(measure)
    finally:
        close(chromium, page)
    assert got["scrollY"] == 0 and (got["width"], got["height"]) == (1366, 900), got
    assert got["docScroll"] <= got["width"], got
    assert [item["id"] for item in got["items"]] == [
        f"distlock-summary-{key}" for key in ("held", "expired", "waiting", "stale", "trouble")
    ]
    for item in got["items"]:
        assert item["top"] >= 0 and item["bottom"] <= got["height"], item
        assert item["left"] >= 0 and item["right"] <= got["width"], item
    texts = {item["id"].rsplit("-", 1)[1]: item["text"] for item in got["items"]}
    assert texts["held"].startswith("1") and "held now" in texts["held"]
    assert texts["stale"].startswith("1") and "stale writes refused today" in texts["stale"]


def test_break_button_only_for_those_who_may_break(
    chromium, live_server, django_user_model, lock_db, admin_shots
):
    lease = acquire("button:held", ttl=600, holder="someone")
    url = f"{live_server.url}/admin/distlock/lock/button:held/change/"
    viewer = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_lock"))
    breaker = django_user_model.objects.create_user("breaker", password="pw", is_staff=True)
    breaker.user_permissions.add(*Permission.objects.filter(
        codename__in=["view_lock", "break_lock"]))

    page = open_as(chromium, viewer, url)
    try:
        def without(browser: Any, api: Any) -> None:
            api.expect(page.locator("h2, .readonly").first).to_be_visible()
            api.expect(page.locator(".field-owner")).to_contain_text(lease.owner)
            api.expect(page.locator("#distlock-break-button")).to_have_count(0)

        chromium.run(without)
    finally:
        close(chromium, page)

    page = open_as(chromium, breaker, url)
    try:
        def with_permission(browser: Any, api: Any) -> None:
            api.expect(page.locator("#distlock-break-button")).to_be_visible()
            page.screenshot(path=str(admin_shots / "lock-page-1366-light.png"))
            page.click("#distlock-break-button")
            api.expect(page.locator("h1")).to_have_text("Break locks?")
            api.expect(page.locator("#distlock-break-list")).to_contain_text(lease.owner)
            page.click("#distlock-confirm-break")
            api.expect(page.locator("ul.messagelist")).to_contain_text(
                "Broke 1 lock(s): button:held")

        chromium.run(with_permission)
    finally:
        close(chromium, page)
    assert Lock.objects.get(name="button:held").is_free
    with pytest.raises(LockLost):
        lease.renew()


# --- the admin's own breadcrumbs, and the pictures' text inside the pictures ------------

CRUMBS = """() => {
    const crumbs = document.querySelector(".breadcrumbs");
    const style = getComputedStyle(crumbs);
    const link = crumbs.querySelector("a");
    return {
        tag: crumbs.tagName.toLowerCase(), background: style.backgroundColor,
        padding: style.padding, color: style.color, link: getComputedStyle(link).color,
        links: [...crumbs.querySelectorAll("a")].map(a => a.getAttribute("href")),
        text: crumbs.innerText.replace(/\\s+/g, " ").trim(),
    };
}"""


def test_breadcrumbs_take_the_admins_own_style(
    chromium, live_server, admin_user, lock_db, settings, admin_shots
):
    """The break confirmation, Overview and Timeline pages write their breadcrumbs as the
    running Django's admin writes its own (a ``div`` up to 6.0, an ``ol`` from 6.1), so
    they get the same bar as a stock page: the background, padding and colours of the
    lock list's breadcrumbs, not the page's bare text."""
    settings.DISTLOCK_AUDIT = True
    acquire("crumbs:held", ttl=600, holder="someone")
    locks = f"{live_server.url}/admin/distlock/lock/"
    page = open_as(chromium, admin_user, locks)
    try:
        def crumbs(browser: Any, api: Any) -> dict[str, dict[str, Any]]:
            api.expect(page.locator("#result_list")).to_be_visible()
            got = {"stock": page.evaluate(CRUMBS)}
            page.goto(f"{locks}overview/")
            api.expect(page.locator("#distlock-held")).to_contain_text("crumbs:held")
            got["Overview"] = page.evaluate(CRUMBS)
            page.goto(f"{locks}timeline/?name=crumbs:held")
            api.expect(page.locator("svg.distlock-timeline")).to_be_visible()
            got["Timeline"] = page.evaluate(CRUMBS)
            page.goto(f"{locks}crumbs:held/change/")
            page.click("#distlock-break-button")
            api.expect(page.locator("h1")).to_have_text("Break locks?")
            got["Break locks"] = page.evaluate(CRUMBS)
            page.screenshot(path=str(admin_shots / "break-confirmation-1366-light.png"))
            return got

        got = chromium.run(crumbs)
    finally:
        close(chromium, page)
    stock = got.pop("stock")
    assert stock["background"] not in ("rgba(0, 0, 0, 0)", "transparent"), stock
    for here, crumb in got.items():
        assert crumb["tag"] == stock["tag"], (here, crumb, stock)
        for look in ("background", "padding", "color", "link"):
            assert crumb[look] == stock[look], (here, look, crumb, stock)
        assert crumb["links"] == ["/admin/", "/admin/distlock/", "/admin/distlock/lock/"]
        assert crumb["text"].endswith(here), crumb
    assert Lock.objects.get(name="crumbs:held").owner  # only looked at: nothing broken


TEXTS = """() => [...document.querySelectorAll("svg.distlock-timeline")].map(svg => {
    const box = svg.getBoundingClientRect();
    const own = t => [...t.childNodes].filter(n => n.nodeType === 3)
        .map(n => n.data).join("");
    const texts = [...svg.querySelectorAll("text")].map(t => {
        const r = t.getBoundingClientRect();
        return {text: own(t), left: r.left - box.left, right: box.right - r.right,
                top: r.top - box.top, bottom: box.bottom - r.bottom};
    });
    return {
        count: texts.length, width: box.width,
        outside: texts.filter(t => Math.min(t.left, t.right, t.top, t.bottom) < -0.5),
        // Labels of the axis' row (ticks, the day, "now …") drawn into each other.
        overlapping: texts.filter(t => t.top < 24).flatMap((a, i, row) => row.slice(i + 1)
            .filter(b => Math.min(box.width - a.right, box.width - b.right)
                         - Math.max(a.left, b.left) > 0.5)
            .map(b => [a.text, b.text])),
        // The legend's labels (not the "!" drawn inside a symbol).
        legend: [...svg.querySelectorAll(".dl-legend text:not(.dl-glyph)")].map(own),
        crosses: svg.querySelectorAll(".dl-legend .dl-x").length,
    };
})"""

PHONE = {"width": 390, "height": 844}


@pytest.fixture
def every_kind(lock_db, settings) -> list[str]:
    """Three locks whose pictures use every symbol of the admin's legend: a grant taken
    over after its lease ran out, its holder's refused write, a renewal and a release; a
    grant broken by an operator, whose holder then finds it lost; one held now."""
    from distlock.core.locks import break_lock
    from distlock.testing import take_over
    from tests.testapp.models import Account

    settings.DISTLOCK_AUDIT = True
    account = Account.objects.create(balance=1)
    story = f"account:{account.pk}"
    old = acquire(story, ttl=30, holder="paused-worker")
    new = take_over(old, ttl=30, holder="next-worker")
    account.balance = 2
    with pytest.raises(StaleToken):
        account.save(fence=old)
    new.renew(ttl=30)
    assert new.release() is True
    broken = acquire("legend:broken-by-an-operator", ttl=600, holder="w-broken")
    assert break_lock(broken.name, by="ops (admin)") is True
    with pytest.raises(LockLost):
        broken.renew()
    acquire(LONG_NAME, ttl=600, holder=LONG_HOLDER)
    return [story, broken.name, LONG_NAME]


def _report_html() -> str:
    """The demo's report (its own code, demo_project/bank/report.py) of a fenced and an
    unfenced run of 2.8 s whose axis ends on a half second: the last time label is drawn
    at the picture's right edge. The events are those the demo's workers record."""
    from dataclasses import dataclass
    from datetime import UTC, datetime

    from demo_project.bank import report
    from distlock.times import expiry_detail, from_us

    @dataclass(frozen=True)
    class Attempt:  # the fields of demo_project.bank.models.Attempt the report reads
        token: int
        worker: str
        outcome: str
        taken_over_by: int | None = None
        wrote_us: int | None = None
        wrote_balance: int | None = None

    s = 1_000_000
    # 11:28:44.630 to 11:28:47.430: the axis (padded by a 40th) ends at 11:28:47.500.
    start = int(datetime(2026, 12, 3, 11, 28, 44, tzinfo=UTC).timestamp()) * s + 630_000

    def grant(at: float, token: int, worker: str, kind: str = "acquired") -> LockEvent:
        at_us = start + round(at * s)
        return LockEvent(at_us=at_us, kind=kind, name=lock, token=token, holder=worker,
                         detail=expiry_detail(from_us(at_us + s // 2)))

    def event(at: float, kind: str, token: int, worker: str, detail: str = "") -> LockEvent:
        return LockEvent(at_us=start + round(at * s), kind=kind, name=lock, token=token,
                         holder=worker, detail=detail)

    pictures, results = {}, {}
    for mode in ("fenced", "unfenced"):
        lock = f"account:1:{mode}"
        events = [
            grant(0, 2, "worker-1"), event(0.3, "released", 2, "worker-1"),
            grant(0.4, 3, "worker-2"), grant(1.0, 4, "worker-1", "took_over"),
            event(1.3, "released", 4, "worker-1"), grant(1.8, 5, "worker-2"),
            event(2.8, "released", 5, "worker-2"),
        ]
        attempts = [Attempt(2, "worker-1", "written"), Attempt(4, "worker-1", "written"),
                    Attempt(5, "worker-2", "written")]
        if mode == "fenced":
            events.append(event(1.5, "stale_write", 3, "worker-2",
                                "bank.Account: write with token 3 refused (row token 4)"))
            attempts.append(Attempt(3, "worker-2", "refused"))
        else:
            attempts.append(Attempt(3, "worker-2", "written", taken_over_by=4,
                                    wrote_us=start + round(1.5 * s), wrote_balance=2))
        pictures[mode] = report.mode_picture(lock, events, attempts, base=1)
        lost = 0 if mode == "fenced" else 1
        results[mode] = {
            "lock": lock, "grants": 4, "stalled": [(3, 0.7, 4)], "complete": True,
            "stale_writes_refused": [(3, 4)] if mode == "fenced" else [],
            "stale_writes_accepted": [] if mode == "fenced" else [(3, 4)],
            "final": 4 - lost, "expected": 4, "lost_updates": lost,
            "first_token": 2, "last_token": 5, "seconds": 2.8,
        }
    assert "11:28:47.500" in pictures["fenced"]  # the label at the right edge
    return report.html({"run": "20261203-112844"}, results, pictures, "Two workers.")


@pytest.mark.parametrize("viewport", [VIEWPORT, PHONE], ids=["1366", "phone"])
def test_every_text_of_the_pictures_lies_inside_them(
    chromium, live_server, admin_user, every_kind, admin_shots, viewport
):
    """On a lock's page, the timeline of several locks and the demo's report, every text
    of every picture lies inside its SVG (no label cut at an edge), and the legend names
    each symbol once."""
    width = viewport["width"]
    story, *_ = every_kind
    locks = f"{live_server.url}/admin/distlock/lock/"
    several = f"{locks}timeline/?" + "&".join(f"name={n}" for n in every_kind)
    report = _report_html()
    page = open_as(chromium, admin_user, f"{locks}{story}/change/", viewport=viewport)
    try:
        def texts(browser: Any, api: Any) -> dict[str, list[dict[str, Any]]]:
            svg = page.locator("svg.distlock-timeline")
            api.expect(svg).to_be_visible()
            got = {"lock page": page.evaluate(TEXTS)}
            page.goto(several)
            api.expect(svg.locator("g[data-lane]")).to_have_count(3)
            got["several locks"] = page.evaluate(TEXTS)
            page.locator("svg.distlock-timeline").screenshot(
                path=str(admin_shots / f"timeline-several-{width}.png"))
            page.set_content(report)
            api.expect(svg).to_have_count(2)
            got["demo report"] = page.evaluate(TEXTS)
            page.screenshot(path=str(admin_shots / f"demo-report-{width}.png"), full_page=True)
            return got

        got = chromium.run(texts)
    finally:
        close(chromium, page)
    assert [len(pictures) for pictures in got.values()] == [1, 1, 2]
    for where, pictures in got.items():
        for svg in pictures:
            assert svg["count"] > 10 and svg["width"] > 0.5 * min(width, 960) - 60, svg
            assert svg["outside"] == [], (where, width, svg["outside"])
            assert svg["overlapping"] == [], (where, width, svg["overlapping"])
            assert len(set(svg["legend"])) == len(svg["legend"]), (where, svg["legend"])
    # Every symbol of the admin's pictures is used, and each is named once: the break's
    # mark is drawn on the broken bar's key, not as a second "broken".
    several = got["several locks"][0]
    assert several["legend"] == [
        "grant (token), released", "lease ran out", "broken", "held now",
        "holder still acting", "expired take-over", "stale write refused", "lease lost",
        "renewed",
    ]
    assert several["crosses"] == 1  # the break's mark, once


APART = """() => {
    const svg = document.querySelector("svg.distlock-timeline");
    const centre = g => {
        const r = g.querySelector("circle, path").getBoundingClientRect();
        return r.left + r.width / 2;
    };
    const lane = name => svg.querySelector(`g[data-lane="${name}"]`);
    return {
        took: [...svg.querySelectorAll('g[data-kind="took_over"]')].map(centre),
        stale: [...svg.querySelectorAll('g[data-kind="stale_write"]')].map(centre),
        lanes: [...svg.querySelectorAll("g[data-lane]")].map(g => g.dataset.lane),
        gone: [...lane("gone").querySelectorAll("g.dl-bar[data-token]")].map(g => ({
            ended: g.dataset.ended, fill: getComputedStyle(g.querySelector("rect")).fill})),
        held: getComputedStyle(svg.querySelector(".dl-legend .dl-bar-held rect")).fill,
        shown: document.querySelector(".distlock-timeline-shown").innerText,
    };
}"""


def test_an_incident_ten_minutes_old_stays_drawn_apart_beside_two_renewing_locks(
    chromium, live_server, admin_user, lock_db, settings, admin_shots
):
    """A take-over and its refused write, ten minutes old, beside two holders that renewed
    every 0.3 s since (more events than a picture reads) and a lease that ran out with
    nobody taking over: the several-locks page draws the take-over and the refused write
    at least 20 px apart, and the unclaimed lease as expired, not in the held colour."""
    from django.db.models import F

    from distlock.db import db_now_us
    from distlock.testing import take_over
    from distlock.times import expiry_detail, from_us
    from tests.support.helpers import wait_until
    from tests.testapp.models import Account

    settings.DISTLOCK_AUDIT = True
    account = Account.objects.create(balance=1)
    old = acquire(f"account:{account.pk}", ttl=30, holder="paused-worker")
    new = take_over(old, ttl=30, holder="next-worker")
    # The paused holder wakes a moment later, as it would (not in the same millisecond).
    taken_at = db_now_us("default")
    wait_until(lambda: db_now_us("default") > taken_at + 500_000, what="half a second")
    account.balance = 2
    with pytest.raises(StaleToken):
        account.save(fence=old)
    minutes_10 = 600 * 1_000_000
    LockEvent.objects.filter(name=old.name).update(at_us=F("at_us") - minutes_10)
    now = db_now_us("default")
    for name in ("renewing:1", "renewing:2"):
        lease = acquire(name, ttl=3600, holder=f"{name}-worker")
        LockEvent.objects.filter(name=name).update(at_us=F("at_us") - minutes_10)
        LockEvent.objects.bulk_create(
            LockEvent(at_us=at, kind="renewed", name=name, token=lease.token,
                      holder=f"{name}-worker", detail=expiry_detail(from_us(at + 3600 * 10**6)))
            for at in range(now - minutes_10, now, 300_000)
        )
    gone = acquire("gone", ttl=0.2, holder="gone-worker")
    wait_until(lambda: db_now_us("default") > (Lock.objects.get(name="gone").expires_us or 0),
               timeout=10, what="the unclaimed lease ran out")
    names = [old.name, "renewing:1", "renewing:2", "gone"]
    url = (f"{live_server.url}/admin/distlock/lock/timeline/?"
           + "&".join(f"name={name}" for name in names))
    page = open_as(chromium, admin_user, url)
    try:
        def look(browser: Any, api: Any) -> dict[str, Any]:
            api.expect(page.locator("svg.distlock-timeline g[data-lane]")).to_have_count(4)
            page.locator(".distlock-timeline-box").screenshot(
                path=str(admin_shots / "timeline-incident-10-minutes-later.png"))
            got = page.evaluate(APART)
            got["texts"] = page.evaluate(TEXTS)
            # The unclaimed lease is now, outside the incident's window: the last 5 minutes.
            page.goto(url + "&range=5m")
            api.expect(page.locator("svg.distlock-timeline g[data-lane]")).to_have_count(4)
            got["gone"] = page.evaluate(APART)["gone"]
            return got

        got = chromium.run(look)
    finally:
        close(chromium, page)
    assert got["lanes"] == names
    (took,), (stale,) = got["took"], got["stale"]
    assert stale - took >= 20, got
    # The axis' last tick and "now: 10 min later →" each readable, not drawn into each other.
    assert [svg["overlapping"] for svg in got["texts"]] == [[]], got["texts"]
    assert "around the latest incident" in got["shown"], got["shown"]
    assert got["gone"] and all(bar["ended"] == "expired" for bar in got["gone"]), got
    assert all(bar["fill"] != got["held"] for bar in got["gone"]), got
    assert gone.token >= 1 and new.token == old.token + 1


# --- one clock: every time on every page in the site's zone, the zone shown ------------

# Every clock time a page shows (its text and its tooltips), outside the timeline's
# picture (its axis is the timeline's own business: distlock/admin/timeline_svg.py).
SHOWN_TIMES = r"""() => {
    const root = document.querySelector("#content") || document.body;
    const skip = el => el.closest("#distlock-timeline, svg, script, style");
    const texts = [];
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    let line = [];
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        if (!skip(node.parentElement)) line.push(node.data);
    }
    texts.push(line.join(" "));
    for (const el of root.querySelectorAll("[title]")) {
        if (!skip(el)) texts.push(el.getAttribute("title"));
    }
    const times = [];
    const raw = [];
    for (const text of texts) {
        const flat = text.replace(/\s+/g, " ");
        for (const m of flat.matchAll(/\b\d\d:\d\d:\d\d(?:\.\d{3})?\b(?: [A-Z][A-Za-z]*\b)?/g)) {
            times.push(m[0]);
        }
        for (const m of flat.matchAll(/\d{4}-\d\d-\d\dT\d\d:\d\d[^ ]*/g)) raw.push(m[0]);
    }
    return {times, raw};
}"""


@pytest.fixture
def zoned_site(lock_db, settings) -> dict[str, Any]:
    """An IST site (+05:30, so a UTC or a naive time shows) with a held and renewed lock,
    one taken over (its detail carries an expiry), an expired one and a refused write."""
    from distlock.testing import take_over

    settings.TIME_ZONE = "Asia/Kolkata"
    settings.DISTLOCK_AUDIT = True
    held = acquire("zone:held", ttl=600, holder="zone-worker")
    held.renew(ttl=600)
    old = acquire("zone:taken", ttl=30, holder="paused-worker")
    take_over(old, ttl=600, holder="next-worker")
    record("stale_write", name="zone:taken", using="default", token=old.token,
           owner=old.owner, holder="paused-worker",
           detail="write with token 1 refused: lock now at token 2 (shop.Account; row token 2)")
    expired_lock("zone:expired", holder="gone-worker")
    renewal = LockEvent.objects.get(name="zone:held", kind="renewed")
    return {"held": held, "renewal": renewal.pk}


def test_every_time_on_every_page_carries_the_site_zone(
    chromium, live_server, admin_user, zoned_site
):
    """Issue 34, one clock: under TIME_ZONE="Asia/Kolkata" the Locks list, a lock's page,
    the events list, an event's page, the break confirmation and the overview show every
    time (text and tooltips) in IST with the zone written, never an audit detail's raw
    UTC ISO; a screenshot of each page."""
    shots = Path(settings.BASE_DIR) / "artifacts" / "browser" / connection.vendor / "zone"
    shots.mkdir(parents=True, exist_ok=True)
    admin = f"{live_server.url}/admin/distlock"
    pages = [
        ("locks", f"{admin}/lock/", "#result_list"),
        ("lock-page", f"{admin}/lock/zone:held/change/", ".field-expires_at"),
        ("events", f"{admin}/lockevent/?kind=all", "#result_list"),
        ("event-page", f"{admin}/lockevent/{zoned_site['renewal']}/change/",
         ".field-detail_shown"),
        ("break", None, "#distlock-break-list"),
        ("overview", f"{admin}/lock/overview/", ".distlock-held-row"),
    ]
    page = open_as(chromium, admin_user, pages[0][1])
    try:
        def visit(browser: Any, api: Any) -> dict[str, dict[str, list[str]]]:
            got = {}
            for n, (name, url, ready) in enumerate(pages, 1):
                if name == "break":
                    page.goto(f"{admin}/lock/zone:held/change/")
                    page.click("#distlock-break-button")
                    api.expect(page.locator("h1")).to_have_text("Break locks?")
                else:
                    page.goto(url)
                api.expect(page.locator(ready).first).to_be_visible()
                got[name] = page.evaluate(SHOWN_TIMES)
                page.screenshot(path=str(shots / f"{n:02}-{name}.png"), full_page=True)
            return got

        got = chromium.run(visit)
    finally:
        close(chromium, page)
    for name, shown in got.items():
        assert shown["raw"] == [], (name, shown["raw"])
        assert shown["times"], f"{name}: no time found on the page"
        unzoned = [time for time in shown["times"] if not time.endswith(" IST")]
        assert unzoned == [], (name, unzoned, shown["times"])
    # The details with an expiry (the renewal's, the take-over's) were read in IST.
    assert any(t.endswith(" IST") and "." in t for t in got["event-page"]["times"])
    assert Lock.objects.get(name="zone:held").owner == zoned_site["held"].owner  # not broken
    assert sorted(p.name for p in shots.glob("*.png")) == [
        f"{n:02}-{name}.png" for n, (name, _, _) in enumerate(pages, 1)]
