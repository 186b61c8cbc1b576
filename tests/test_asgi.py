"""The demo's async view (demo_project/bank/views.py) under ASGI: a deposit under ``alock``,
written with ``await account.asave(fence=lease)``.

Through Django's AsyncClient in this process, and served by a real ASGI server process
(uvicorn) on the test database, with concurrent requests from a thread pool. What must
hold: the deposits never overlap (each holder read the balance its predecessor wrote, in
token order), the tokens are distinct and the row keeps the last one, no deposit is lost,
a stale write is refused, and bad input takes no lock and changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.cookiejar import CookieJar
from typing import Any
from urllib.parse import urlencode

import pytest
from django.test import AsyncClient

from demo_project.bank import views
from demo_project.bank.models import Account
from distlock.models import Lock
from tests.support.asgi_server import asgi_server
from tests.support.helpers import run_async

pytestmark = pytest.mark.usefixtures("lock_db")


def url(pk: int) -> str:
    return f"/bank/accounts/{pk}/"


def assert_serial(deposits: list[dict[str, Any]], start: int = 0) -> None:
    """In token order, each deposit read what the one before it wrote: no overlap, no loss."""
    ordered = sorted(deposits, key=lambda got: got["token"])
    tokens = [got["token"] for got in ordered]
    assert len(set(tokens)) == len(tokens), tokens
    assert [got["read"] for got in ordered] == list(range(start, start + len(ordered)))
    assert [got["balance"] for got in ordered] == [got["read"] + 1 for got in ordered]


def test_async_client_deposits_under_the_lock_with_fenced_writes():
    account = Account.objects.create(name="async client")

    async def body() -> list[Any]:
        client = AsyncClient()
        return await asyncio.gather(
            *(client.post(url(account.pk), {"amount": "1", "work": "0.01"}) for _ in range(6))
        )

    responses = run_async(body)
    assert [r.status_code for r in responses] == [200] * 6
    deposits = [r.json() for r in responses]
    assert_serial(deposits)
    account.refresh_from_db()
    assert account.balance == 6
    assert account.fence_token == max(got["token"] for got in deposits)
    lock = Lock.objects.get(name=f"account:{account.pk}")
    assert lock.is_free and lock.token == account.fence_token

    shown = run_async(lambda: AsyncClient().get(url(account.pk)))
    assert shown.status_code == 200 and "csrftoken" in shown.cookies
    assert shown.json() == {"account": account.pk, "balance": 6,
                            "fence_token": account.fence_token}


def test_a_deposit_whose_lease_ran_out_is_refused_and_changes_nothing(monkeypatch):
    account = Account.objects.create(name="stale", balance=5)
    monkeypatch.setattr(views, "LOCK_TTL", 0.2)

    async def body() -> Any:
        return await AsyncClient().post(url(account.pk), {"amount": "1", "work": "0.5"})

    response = run_async(body)
    assert response.status_code == 409, response.content
    assert "refused" in response.json()["error"]
    account.refresh_from_db()
    assert (account.balance, account.fence_token) == (5, 0)
    assert Lock.objects.get(name=f"account:{account.pk}").token > 0  # it was granted


@pytest.mark.parametrize(
    ("data", "status"),
    [
        ({"amount": "ten"}, 400),
        ({"amount": "1", "work": "nan"}, 400),
        ({"amount": "1", "work": "-1"}, 400),
        ({"amount": str(10**7)}, 400),
    ],
)
def test_bad_input_takes_no_lock_and_changes_nothing(data, status):
    account = Account.objects.create(name="bad input", balance=3)

    response = run_async(lambda: AsyncClient().post(url(account.pk), data))
    assert response.status_code == status and "error" in response.json()
    account.refresh_from_db()
    assert (account.balance, account.fence_token) == (3, 0)
    assert not Lock.objects.filter(name=f"account:{account.pk}").exists()


def test_unknown_account_and_other_methods():
    missing = run_async(lambda: AsyncClient().post(url(999_999), {"amount": "1"}))
    assert missing.status_code == 404
    assert not Lock.objects.filter(name="account:999999").exists()
    assert run_async(lambda: AsyncClient().get(url(999_999))).status_code == 404
    assert run_async(lambda: AsyncClient().delete(url(999_999))).status_code == 405


@pytest.mark.processes
def test_a_real_asgi_server_serves_concurrent_deposits_one_at_a_time():
    account = Account.objects.create(name="served")
    requests, work = 24, 0.02
    cookies = CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(cookies))

    with asgi_server() as base:
        # The GET sets the CSRF cookie; each POST sends it back with the token header.
        with opener.open(base + url(account.pk), timeout=30) as got:
            assert json.load(got)["balance"] == 0
        token = next(cookie.value for cookie in cookies if cookie.name == "csrftoken")

        def deposit(_: int) -> dict[str, Any]:
            request = urllib.request.Request(
                base + url(account.pk), method="POST",
                data=urlencode({"amount": 1, "work": work}).encode(),
                headers={"X-CSRFToken": token},
            )
            try:
                with opener.open(request, timeout=60) as response:
                    return json.load(response)
            except urllib.error.HTTPError as exc:
                raise AssertionError(f"{exc.code}: {exc.read()[:500]!r}") from None

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            deposits = list(pool.map(deposit, range(requests)))
        took = time.monotonic() - started
        with opener.open(base + url(account.pk), timeout=30) as got:
            shown = json.load(got)

    assert_serial(deposits)
    # The critical sections never overlapped, so together they took at least this long.
    assert took >= requests * work
    account.refresh_from_db()
    assert account.balance == requests == shown["balance"]
    assert account.fence_token == max(got["token"] for got in deposits) == shown["fence_token"]
    lock = Lock.objects.get(name=f"account:{account.pk}")
    assert lock.is_free and lock.token == account.fence_token
