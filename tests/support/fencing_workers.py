"""Child-process roles for tests/test_fencing.py (run by tests/support/worker.py).

Each role acquires a real lease in its own process and writes fenced rows when told to,
so the parent can pause it with SIGSTOP at the worst moment and see what the database
lets it commit afterwards.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from django.apps import apps
from django.db import connection, transaction
from django.test.utils import override_settings

from tests.support.worker import command, emit, lease_data


def _db_now_us() -> int:
    from distlock.db import db_now_us

    return db_now_us("default")


def _load(model_label: str, pk: Any) -> Any:
    return apps.get_model(model_label)._base_manager.get(pk=pk)


def writer(model_label: str, pk: Any, ttl: float) -> None:
    """Acquire the row's lock, read the row, then obey: check, write, release, exit.

    The row is read right after the grant (as a holder reads before it computes), so a
    "write" after a pause writes what the holder believed then.
    """
    from distlock import acquire

    obj = _load(model_label, pk)
    lease = acquire(obj.get_fence_name(), ttl=ttl, timeout=60)
    assert lease is not None
    obey(lease, obj, lambda: obj.save(fence=lease), lease.release)


def obey(lease: Any, obj: Any, save: Callable[[], object], release: Callable[[], bool]) -> None:
    """The holder's commands after its grant: check, write (with ``save``), release (with
    ``release``), exit. Shared by the sync writer and the async one (async_workers)."""
    from distlock import StaleToken

    emit("acquired", **lease_data(lease))
    while True:
        order = command()
        kind = order["command"]
        if kind == "check":
            lease.check()  # raises LockLost (reported as an error) if the lease ran out
            emit("checked", remaining=lease.remaining())
        elif kind == "write":
            obj.note = order["note"]
            obj.balance += 1
            try:
                save()
            except StaleToken as exc:
                emit("refused", message=str(exc), lost=lease.lost)
            else:
                emit("wrote", token=lease.token, db_us=_db_now_us())
        elif kind == "release":
            emit("released", held=release())
        elif kind == "exit":
            return


def commit_later(model_label: str, pk: Any, ttl: float, note: str) -> None:
    """Write fenced inside atomic(), then wait for "commit" before committing.

    The parent pauses this process between the ownership check and the commit: the
    shared row lock taken by the check must make a take-over wait for the commit.
    """
    from distlock import acquire

    obj = _load(model_label, pk)
    lease = acquire(obj.get_fence_name(), ttl=ttl, timeout=60)
    assert lease is not None
    emit("acquired", **lease_data(lease))
    command()
    with transaction.atomic():
        obj.note = note
        obj.save(fence=lease)
        # Last statement of the transaction, by the database clock.
        with connection.cursor() as cursor:
            from distlock.backends import backend_for

            cursor.execute(f"SELECT {backend_for(connection).now_sql()}")
            last_us = int(cursor.fetchone()[0])
        emit("written", last_us=last_us)
        command()
    emit("committed", db_us=_db_now_us())


def incrementer(key: str, count: int, ttl: float, pauses: int, seed: int) -> None:
    """``count`` read-modify-write increments of Counter ``key``, each under a new lease.

    ``pauses`` of them sleep 1.5 × ttl between the read and the write (a GC pause past
    the lease), so that write must be refused. Reports the values it wrote.
    """
    from distlock import StaleToken, acquire
    from tests.testapp.models import Counter

    rng = random.Random(seed)
    pause_at = set(rng.sample(range(count), pauses))
    acked: list[int] = []
    tokens: list[int] = []
    refused = 0
    emit("ready")
    command()
    # Poll often: eight processes hand one lock round 1,600 times.
    with override_settings(DISTLOCK_POLL_INTERVAL=0.005, DISTLOCK_POLL_MAX_INTERVAL=0.03):
        for i in range(count):
            lease = acquire(f"counter:{key}", ttl=ttl, timeout=120)
            assert lease is not None
            counter = Counter.objects.get(key=key)
            if i in pause_at:
                time.sleep(ttl * 1.5)
            counter.value += 1
            try:
                counter.save(fence=lease, update_fields=["value"])
            except StaleToken:
                refused += 1
            else:
                acked.append(counter.value)
                tokens.append(lease.token)
            lease.release()
    emit("done", acked=acked, tokens=tokens, refused=refused, pauses=pauses)


def audited_writer(model_label: str, pk: Any, ttl: float) -> None:
    """:func:`writer` with the audit history on (DISTLOCK_AUDIT), for the timeline's
    browser test: the grant, the take-over and the refused write become LockEvents."""
    with override_settings(DISTLOCK_AUDIT=True):
        writer(model_label, pk, ttl)
