"""An async view: a deposit into an account under ``alock``, written with a fenced save.

``GET /bank/accounts/<pk>/`` shows the balance (and sets the CSRF cookie a POST needs);
``POST`` with ``amount`` (an integer, default 1) deposits it by read-modify-write inside
``async with alock("account:<pk>")``, and writes with ``await account.asave(fence=lease)``.
While a request waits for the lock it holds no thread: other requests go on. If its
lease runs out before the write (``work``, seconds of pretended work, makes that easy to
try), the database refuses the write and the answer is 409; nothing is changed.

Served by an ASGI server: ``uvicorn demo_project.asgi:application``.
"""

from __future__ import annotations

import asyncio
import math

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import ensure_csrf_cookie
from django.views.decorators.http import require_http_methods

from demo_project.bank.models import Account
from distlock import LockTimeout, StaleToken, alock

LOCK_TTL = 10.0  # seconds: a deposit's lease
LOCK_WAIT = 10.0  # seconds a request waits for the lock before answering 503
MAX_WORK = 30.0  # seconds of pretended work a request may ask for (past LOCK_TTL: stale)
MAX_AMOUNT = 10**6


def _error(message: str, status: int) -> JsonResponse:
    return JsonResponse({"error": message}, status=status)


def _shown(account: Account) -> dict[str, object]:
    return {"account": account.pk, "balance": account.balance,
            "fence_token": account.fence_token}


@require_http_methods(["GET", "POST"])
@ensure_csrf_cookie
async def account(request: HttpRequest, pk: int) -> JsonResponse:
    """Show account ``pk`` (GET) or deposit into it under its lock (POST)."""
    if request.method == "GET":
        found = await Account.objects.filter(pk=pk).afirst()
        if found is None:
            return _error(f"no account {pk}", 404)
        return JsonResponse(_shown(found))
    # Checked before the lock is asked for: bad input takes no lock and changes nothing.
    try:
        amount = int(request.POST.get("amount", "1"))
        work = float(request.POST.get("work", "0"))
    except ValueError:
        return _error("amount must be an integer and work a number of seconds", 400)
    if abs(amount) > MAX_AMOUNT or not (math.isfinite(work) and 0 <= work <= MAX_WORK):
        return _error(f"amount must be within ±{MAX_AMOUNT} and work within "
                      f"0–{MAX_WORK} s", 400)
    if not await Account.objects.filter(pk=pk).aexists():
        return _error(f"no account {pk}", 404)
    try:
        async with alock(f"account:{pk}", ttl=LOCK_TTL, timeout=LOCK_WAIT) as lease:
            found = await Account.objects.aget(pk=pk)
            read = found.balance
            if work:
                await asyncio.sleep(work)
            found.balance = read + amount
            # One conditional UPDATE: refused unless this lease still holds account:<pk>.
            await found.asave(fence=lease, update_fields=["balance"])
    except LockTimeout:
        return _error(f"account {pk} stayed locked for {LOCK_WAIT} s; try again", 503)
    except StaleToken as exc:
        return _error(f"the lease ran out before the write, which was refused: {exc}", 409)
    return JsonResponse({**_shown(found), "read": read, "token": lease.token})
