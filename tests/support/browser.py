"""Headless Chromium through Playwright, for the browser tests (tests/test_browser.py).

Debian's ``chromium`` package and the ``playwright`` Python package (the dev extra);
Playwright's own browser downloads are never used. Without them a browser test is skipped
with the reason, unless DISTLOCK_REQUIRE_BROWSER=1 (CI), which makes the skip a failure.

:class:`BrowserThread` keeps one browser for a whole test module in a thread of its own.
Playwright's sync API runs an asyncio loop in the thread that starts it, and Django
refuses ORM calls beside a running loop, so with the browser in its own thread the tests
use the ORM as usual on the main thread (and their database teardown works), and hand
the browser work to the browser thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from django.db import connections

CHROMIUM = os.environ.get("DISTLOCK_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
TIMEOUT_MS = 30_000  # generous: the machine is shared with other test runs
T = TypeVar("T")


def browser_or_skip() -> Any:
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

    For a test that drives Playwright on its own thread: there Django refuses ORM calls
    next to the running loop, and greenlet switches give queries a connection that the
    test's teardown never closes (PostgreSQL then cannot drop the test database).
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


class BrowserThread:
    """One headless Chromium in a thread of its own; ``run(fn)`` calls ``fn(browser,
    sync_api)`` there and returns its result (or raises its exception here)."""

    def __init__(self, sync_api: Any) -> None:
        self.sync_api = sync_api
        self.jobs: queue.Queue[tuple[Callable[..., Any], queue.Queue[Any]] | None] = (
            queue.Queue()
        )
        started: queue.Queue[BaseException | None] = queue.Queue()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        problem = started.get(timeout=120)
        if problem is not None:
            raise problem

    def _serve(self, started: queue.Queue[BaseException | None]) -> None:
        try:
            playwright = self.sync_api.sync_playwright().start()
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM, args=ARGS, headless=True
            )
        except BaseException as exc:  # reported to the starting thread
            started.put(exc)
            return
        started.put(None)
        try:
            while (job := self.jobs.get()) is not None:
                work, answer = job
                try:
                    answer.put((True, work(browser, self.sync_api)))
                except BaseException as exc:
                    answer.put((False, exc))
        finally:
            browser.close()
            playwright.stop()

    def run(self, work: Callable[..., T], timeout: float = 300) -> T:
        answer: queue.Queue[Any] = queue.Queue()
        self.jobs.put((work, answer))
        ok, value = answer.get(timeout=timeout)
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(60)
