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
