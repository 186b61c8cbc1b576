"""Child-process roles of the async API's tests (``tests.support.async_workers:<role>``).

Run by tests/support/worker.py like its own roles: one JSON event per line out, commands
in on stdin. Each role runs its coroutines with ``asyncio.run``; reading a command blocks
the process between runs, never inside one.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from django.apps import apps

from tests.support.fencing_workers import obey
from tests.support.helpers import run_async, us
from tests.support.worker import command, emit, lease_data


def ahammer(name: str, coroutines: int, count: int, ttl: float, hold_ms: float) -> None:
    """``coroutines`` coroutines in this process, each taking lock ``name`` ``count`` times
    with ``aacquire``; every grant is reported (as the sync ``hammer`` role does)."""
    from distlock import aacquire

    async def one() -> None:
        for _ in range(count):
            lease = await aacquire(name, ttl=ttl, timeout=120)
            assert lease is not None
            await asyncio.sleep(random.uniform(0, hold_ms) / 1000)
            held = await lease.arelease()
            emit("grant", **lease_data(lease), released_us=us(lease.released_at), held=held)

    async def all_of_them() -> None:
        await asyncio.gather(*(one() for _ in range(coroutines)))

    emit("ready")
    command()
    run_async(all_of_them, seconds=180)
    emit("done")


def awriter(model_label: str, pk: Any, ttl: float) -> None:
    """The async twin of fencing_workers.writer: aacquire the row's lock, read the row,
    then obey check / write (``asave(fence=)``) / release / exit."""
    from distlock import aacquire

    model = apps.get_model(model_label)
    obj = model._base_manager.get(pk=pk)

    async def take() -> Any:
        return await aacquire(obj.get_fence_name(), ttl=ttl, timeout=60)

    lease = run_async(take)
    assert lease is not None
    obey(lease, obj, lambda: run_async(lambda: obj.asave(fence=lease)),
         lambda: run_async(lease.arelease))
