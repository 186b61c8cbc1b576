"""The admin in a real browser: headless Chromium driven by Playwright against the live
server. Log in, see a held lock, break it through the confirmation page, see it free and
the event recorded. Screenshots go to artifacts/browser/<backend>/.

Needs Debian's ``chromium`` package (``apt-get install -y chromium``) and the ``playwright``
Python package (the dev extra); Playwright's own browser downloads are never used. Without
them the test is skipped with the reason, unless DISTLOCK_REQUIRE_BROWSER=1 (CI), which
turns the skip into a failure.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from django.conf import settings
from django.db import connection, connections

from distlock import LockLost, acquire
from distlock.models import Lock, LockEvent

CHROMIUM = os.environ.get("DISTLOCK_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
T = TypeVar("T")
TIMEOUT_MS = 30_000  # generous: the machine is shared with other test runs


def _browser_or_skip():
    """Return playwright.sync_api, or skip (fail under DISTLOCK_REQUIRE_BROWSER=1)."""
    problem = None
    try:
        from playwright import sync_api
    except ImportError:
        problem = "the playwright package is not installed (pip install -e '.[dev]')"
    if problem is None and not os.access(CHROMIUM, os.X_OK):
        problem = f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
    if problem is None:
        return sync_api
    message = f"BROWSER TEST NOT RUN: {problem}"
    if os.environ.get("DISTLOCK_REQUIRE_BROWSER") == "1":
        pytest.fail(message + " — DISTLOCK_REQUIRE_BROWSER=1 demands it", pytrace=False)
    pytest.skip(message + "; set DISTLOCK_REQUIRE_BROWSER=1 to make this a failure")


def in_thread(query: Callable[[], T]) -> T:
    """Run an ORM query in a thread of its own, with its own connection, closed after.

    Playwright's sync API runs an asyncio loop here (Django refuses ORM calls next to a
    running loop) and switches greenlets, which gives queries a connection that the test's
    teardown never closes (PostgreSQL then cannot drop the test database).
    """
    result: list[T] = []

    def run() -> None:
        try:
            result.append(query())
        finally:
            connections.close_all()

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(60)
    assert result, "the query failed or hung; see the thread's traceback above"
    return result[0]


@pytest.fixture
def shots(request) -> Path:
    folder = Path(settings.BASE_DIR) / "artifacts" / "browser" / connection.vendor
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    return folder


def test_break_a_lock_in_the_browser(live_server, django_user_model, settings, shots):
    sync_api = _browser_or_skip()
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
            expect(row.locator(".field-holder")).to_contain_text("nightly-report")
            expect(row.locator(".field-token")).to_have_text(str(lease.token))
            expect(row.locator(".distlock-relative")).to_have_text(re.compile(r"\(in \d+ s\)"))
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
            page.screenshot(path=str(shots / "03-broken.png"), full_page=True)

            page.goto(f"{live_server.url}/admin/distlock/lockevent/?kind=broken")
            event = page.locator("#result_list tbody tr", has_text="report:browser")
            expect(event.locator(".distlock-broken")).to_have_text("broken")
            expect(event.locator(".field-by")).to_have_text("ops (admin)")
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

    sync_api = _browser_or_skip()
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
