"""The worker of the stress harness.

Run as ``python -m tests.support.worker tests.support.stress_workers:run ARGS``.

Loop until the stop file appears: pick a lock, acquire → read the Resource → hold →
fenced write (value = read + 1) with its Write row in the same transaction → release.
Every step's outcome is printed as one JSON line (the harness sends stdout to this
worker's history file); ``ok`` means the call returned, ``info`` that it raised a
database error and the outcome is unknown to this worker.

Two test-only weakenings let the checker prove it can fail (tests/test_history.py):

* ``fencing=False``: the write is a plain UPDATE, as if FencedModel did not exist;
* ``weak_clock=True``: acquire decides with the database clock as it was read when the
  call began (like PostgreSQL's ``now()``, frozen at the start of a transaction), and the
  request then takes up to 200 ms to reach the row lock, as a slow network or a GC pause
  would make it. Nothing in distlock changes: the patch lives in this process only.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

HOLDS = ((0.7, 0.0, 0.05), (0.2, 0.05, 0.3))  # (probability, min s, max s); else > ttl


def record(**fields: Any) -> None:
    fields["pid"] = os.getpid()
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def hold_time(rng: random.Random, ttl: float) -> float:
    """Mostly short holds; one in ten longer than the ttl, so leases run out mid-hold."""
    draw = rng.random()
    for probability, low, high in HOLDS:
        if draw < probability:
            return rng.uniform(low, high)
        draw -= probability
    return 1.5 * ttl


def name_connections(worker: str) -> None:
    """Tag this worker's PostgreSQL sessions so the nemesis can find and terminate them."""
    from django.db import connections

    for alias in connections:
        settings_dict = connections[alias].settings_dict
        if settings_dict["ENGINE"].endswith("postgresql"):
            settings_dict.setdefault("OPTIONS", {})["application_name"] = (
                f"distlock-worker-{worker}"
            )


def weaken_clock(rng: random.Random) -> None:
    """Make this process's acquire use a stale clock (the self-test's weakened build)."""
    from django.db import connections

    from distlock import db
    from distlock.backends import backend_for
    from distlock.backends.base import Backend
    from distlock.core import grants

    frozen = threading.local()
    real_try_once = grants.try_once

    def try_once(request: Any) -> Any:
        frozen.us = db.db_now_us(request.alias)
        time.sleep(rng.uniform(0.0, 0.2))
        try:
            return real_try_once(request)
        finally:
            frozen.us = None

    for backend in {id(b): b for b in map(backend_for, connections.all())}.values():
        real_now_sql = backend.now_sql

        def now_sql(real_now_sql: Any = real_now_sql) -> str:
            value = getattr(frozen, "us", None)
            return real_now_sql() if value is None else str(int(value))

        backend.now_sql = now_sql  # type: ignore[method-assign]
        # distlock's portable path (PostgreSQL's server-side function reads the real
        # clock itself), deciding with whatever now_sql() says.
        backend.acquire_existing = Backend.acquire_existing.__get__(backend)  # type: ignore[method-assign]
    grants.try_once = try_once


def drop_broken_connections() -> None:
    """After a database error: drop every connection that broke (terminated backend,
    server restart, network cut), so the next call opens a new one, as a worker outside
    Django's request cycle must do itself."""
    import django.db
    from django.db import connections

    django.db.close_old_connections()
    for alias in connections:
        connection = connections[alias]
        if connection.connection is not None and not connection.is_usable():
            connection.close()


def write(lease: Any, name: str, read_value: int, op_id: str, worker: str,
          fencing: bool, before_commit: Callable[[], None] | None = None) -> int:
    """The guarded write and its ground-truth row, in one transaction. Returns the version.

    ``before_commit`` runs last inside the transaction: the partition test
    (tests/test_partition.py) holds the transaction open there while it cuts the network.
    """
    from django.db import transaction
    from django.db.models import F

    from distlock.db import db_now_us
    from tests.stressapp.models import Resource, Write

    with transaction.atomic():
        before = db_now_us("default")
        rows = Resource.objects.filter(name=name)
        changes = {"value": read_value + 1, "version": F("version") + 1}
        count = rows.fenced_update(lease, **changes) if fencing else rows.update(**changes)
        if count != 1:
            raise RuntimeError(f"write to {name} changed {count} rows")
        version = rows.values_list("version", flat=True).get()
        Write.objects.create(
            name=name, version=version, op_id=op_id, worker=worker, token=lease.token,
            read_value=read_value, new_value=read_value + 1, before_us=before,
            after_us=db_now_us("default"),
        )
        if before_commit is not None:
            before_commit()
    return version


def run(worker: str, names: list[str], ttl: float, seed: int, stop_path: str,
        fencing: bool = True, weak_clock: bool = False, limit: float = 600.0,
        pause_after_error: float = 0.0) -> None:
    from django.db import DatabaseError, connections

    from distlock import acquire
    from distlock.backends import pg_syncrep
    from distlock.exceptions import LockLost, NotReplicated, StaleToken
    from tests.stressapp.models import Resource
    from tests.support.helpers import us

    rng = random.Random(seed)
    name_connections(worker)
    if weak_clock:
        weaken_clock(rng)
    from distlock.db import db_now_us

    # How far this process's wall clock is from the database's (faketime workers: ±30 s).
    skew = time.time() - db_now_us("default") / 1e6
    record(type="start", worker=worker, fencing=fencing, weak_clock=weak_clock,
           skew=round(skew, 3))
    give_up = time.monotonic() + limit
    ops = 0

    def failed(kind: str, exc: BaseException, **fields: Any) -> None:
        record(type=kind, status="info", worker=worker, error=repr(exc)[:300], **fields)
        drop_broken_connections()
        # A client's back-off while its server is down (a failover): not a hot loop of
        # connection attempts.
        time.sleep(pause_after_error)

    while not os.path.exists(stop_path) and time.monotonic() < give_up:
        ops += 1
        op_id = f"{worker}:{ops}"
        name = rng.choice(names)
        try:
            lease = acquire(name, ttl=ttl, timeout=3 * ttl)
        except DatabaseError as exc:
            failed("acquire", exc, lock=name, op_id=op_id)
            continue
        except NotReplicated as exc:
            # Committed on the primary, its wait for the standby cancelled: not a grant.
            record(type="acquire", status="not_replicated", worker=worker, lock=name,
                   op_id=op_id, error=str(exc)[:300])
            continue
        if lease is None:
            record(type="acquire", status="fail", worker=worker, lock=name, op_id=op_id)
            continue
        record(
            type="acquire", status="ok", worker=worker, lock=name, op_id=op_id,
            token=lease.token, owner=lease.owner, acquired_us=us(lease.acquired_at),
            expires_us=us(lease.expires_at),
        )
        try:
            value = Resource.objects.values_list("value", flat=True).get(name=name)
        except DatabaseError as exc:
            failed("read", exc, lock=name, op_id=op_id)
        else:
            hold = hold_time(rng, ttl)
            if hold > ttl / 2 and rng.random() < 0.5:
                # Half of the long holds renew half-way, so renewals meet the nemesis too.
                time.sleep(ttl / 2)
                hold -= ttl / 2
                try:
                    lease.renew()
                except LockLost as exc:
                    record(type="renew", status="lost", worker=worker, lock=name,
                           op_id=op_id, token=lease.token, reason=exc.reason)
                except DatabaseError as exc:
                    failed("renew", exc, lock=name, op_id=op_id, token=lease.token)
                except NotReplicated as exc:
                    record(type="renew", status="not_replicated", worker=worker, lock=name,
                           op_id=op_id, token=lease.token, error=str(exc)[:300])
                else:
                    record(type="renew", status="ok", worker=worker, lock=name,
                           op_id=op_id, token=lease.token, expires_us=us(lease.expires_at))
            time.sleep(hold)
            record(type="write", status="invoke", worker=worker, lock=name, op_id=op_id,
                   token=lease.token)
            # The write commits in its own atomic(), which distlock does not check for a
            # cancelled synchronous wait: the worker looks at the session's mark itself.
            pg_syncrep.watching(connections["default"])
            try:
                version = write(lease, name, value, op_id, worker, fencing)
                warning = pg_syncrep.unreplicated(connections["default"])
                if warning is not None:
                    raise NotReplicated(f"write {op_id}", warning)
            except StaleToken as exc:
                record(type="write", status="rejected", worker=worker, lock=name,
                       op_id=op_id, token=lease.token, error=str(exc)[:200])
            except DatabaseError as exc:
                failed("write", exc, lock=name, op_id=op_id, token=lease.token)
            except NotReplicated as exc:
                # Indeterminate (status info): a failover may keep it or lose it.
                record(type="write", status="info", worker=worker, lock=name, op_id=op_id,
                       token=lease.token, not_replicated=True, error=str(exc)[:300])
            else:
                record(type="write", status="ok", worker=worker, lock=name, op_id=op_id,
                       token=lease.token, version=version)
        try:
            held = lease.release()
        except (DatabaseError, LockLost) as exc:
            failed("release", exc, lock=name, op_id=op_id, token=lease.token)
        else:
            record(type="release", status="ok", worker=worker, lock=name, op_id=op_id,
                   token=lease.token, held=held)
    record(type="stop", worker=worker, ops=ops)


def agent(label: str, name: str) -> None:
    """A lock user driven command by command (tests/test_faults.py).

    Commands: ``acquire`` (ttl, timeout), ``renew``, ``release``, ``write`` (fenced +1 on
    the Resource of the lock), ``write_and_wait`` (the same, then waits for ``commit``
    inside the open transaction), ``write_alone`` (the same, committed on its own: no
    transaction around it), ``exit``. Database errors are reported as ``dberror``
    events with the exception's class, and the broken connection is dropped, as a real
    worker outside the request cycle must do; NotReplicated as ``not_replicated``.
    """
    from django.db import DatabaseError, transaction
    from django.db.models import F

    from distlock import LockLost, NotReplicated, acquire
    from distlock.exceptions import StaleToken
    from tests.stressapp.models import Resource
    from tests.support.worker import command, emit, lease_data

    name_connections(f"agent-{label}")
    lease = None

    def dberror(exc: BaseException) -> None:
        emit("dberror", kind=type(exc).__name__, error=str(exc)[:300])
        drop_broken_connections()

    def fenced_write(wait: bool) -> None:
        with transaction.atomic():
            Resource.objects.filter(name=name).fenced_update(lease, value=F("value") + 1)
            if wait:
                emit("uncommitted")
                command()
        emit("written", token=lease.token)

    emit("ready")
    while True:
        order = command()
        what = order["command"]
        try:
            if what == "acquire":
                got = acquire(name, ttl=order["ttl"], timeout=order.get("timeout", 0))
                if got is None:
                    emit("busy")
                else:
                    lease = got
                    emit("acquired", **lease_data(lease))
            elif what == "renew":
                lease.renew()
                emit("renewed", **lease_data(lease))
            elif what == "release":
                emit("released", held=lease.release())
            elif what in ("write", "write_and_wait"):
                fenced_write(what == "write_and_wait")
            elif what == "write_alone":
                Resource.objects.filter(name=name).fenced_update(lease, value=F("value") + 1)
                emit("written", token=lease.token)
            elif what == "exit":
                return
        except LockLost as exc:
            emit("lost", reason=exc.reason)
        except StaleToken as exc:
            emit("stale", error=str(exc))
        except NotReplicated as exc:
            emit("not_replicated", operation=exc.operation, error=str(exc))
            drop_broken_connections()
        except DatabaseError as exc:
            dberror(exc)
