"""Enqueue-time uniqueness: don't send the same work twice.

A burst of saves each enqueueing "reindex product 42", or a retrying client enqueueing
"charge invoice 7" again, puts many copies of one task on the queue. Redis-based locks
(celery-once, celery-singleton) drop the copies at enqueue time, but not in the
transaction of the write that caused them: a rolled-back write still enqueued its task, and
a worker killed mid-run leaves its key behind until someone deletes it.

:func:`enqueue_once` keeps the key in the application's own database, as a row of
:class:`~distlock.models.TaskKey`, **in the caller's transaction**: the row is upserted
and locked with the business write, and the task is sent by ``transaction.on_commit``. A
rolled-back write sends nothing and leaves no row; a committed one sends its task (or was
covered by a task already queued). Concurrent callers of one key queue on its row lock, so
exactly one of them sends. Each key has two slots, each ending by the database clock:

- the *queued* slot, from the send until the run starts (at most ``ttl``);
- the *running* slot, from the start of the run until it ends (at most ``ttl``: a worker
  killed mid-run blocks its key until then, and no longer).

Policies (the latest enqueue's policy is the key's):

- ``"queued"``: at most one task of the key queued or running; an enqueue while one is
  covers nothing new and sends nothing (celery-once's behaviour);
- ``"one_running_one_queued"``: at most one queued beside one running; the queued run
  waits in its worker for the running slot, so runs of the key never overlap and an
  enqueue during a run is not lost;
- ``"debounce"``: every enqueue sends with a countdown of ``window`` seconds and becomes
  the key's latest generation; a run that is not the latest skips its body, so a burst
  runs once, with the last enqueue's arguments.

The task function carries :func:`unique_task` (under the task decorator): the wrapper
takes the key's slots in the worker. The key travels as the keyword argument
``distlock_unique``; a call without it (a plain ``.delay()``) runs the body as before.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Literal, TypeVar

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.db import connections, router, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from distlock.constants import HOLDER_LENGTH, PURGE_BATCH
from distlock.constants import TASK_KEY_TABLE as TABLE
from distlock.validation import Seconds, check_name, check_seconds, check_ttl, check_using

__all__ = [
    "POLICIES", "UNIQUE_KWARG", "aenqueue_once", "enqueue_once", "purge_task_keys", "unique_task",
]

logger = logging.getLogger("distlock.integrations.unique")

R = TypeVar("R")

Policy = Literal["queued", "one_running_one_queued", "debounce"]
POLICIES: tuple[str, ...] = ("queued", "one_running_one_queued", "debounce")

#: The keyword argument that carries (key, generation, alias) to the run.
UNIQUE_KWARG = "distlock_unique"

# A queued run waiting for the running slot looks again after this long, doubling up to
# the most (a short transaction each time: the slot ends by release or by the clock).
POLL_FIRST, POLL_MOST = 0.02, 0.25


def enqueue_once(
    key: str,
    task: Any,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    policy: Policy = "queued",
    ttl: float | timedelta | None = None,
    window: float | timedelta | None = None,
    using: str | None = None,
) -> bool:
    """Send ``task(*args, **kwargs)`` when the caller's transaction commits, unless a task
    of ``key`` already covers it; True if this call sends.

    ``task`` is a Celery task or a Django task whose function carries
    :func:`unique_task`. ``policy`` is ``"queued"``, ``"one_running_one_queued"`` or
    ``"debounce"`` (which needs ``window``, the countdown of each send). ``ttl`` bounds
    each slot of the key by the database clock (default DISTLOCK_DEFAULT_TTL): make it
    longer than the queue's delay plus the longest run. ``using`` is the database of the
    key row (default: where TaskKey is written); put the business write on the same
    alias, so that both commit or roll back together.

    Inside ``atomic()`` on that alias the key row joins the caller's transaction and the
    send waits for its commit (nothing is sent if it rolls back); outside, the call is its
    own transaction and sends at once. Raises TypeError/ValueError for bad arguments and
    TransactionManagementError with autocommit turned off by hand (Django cannot tell
    when such a transaction commits), writing and sending nothing.
    """
    plan = _Plan(key, task, args, kwargs, policy, ttl, window, using)
    connection = connections[plan.alias]
    if not connection.in_atomic_block and not connection.get_autocommit():
        raise TransactionManagementError(
            "enqueue_once() cannot run with autocommit turned off by hand: Django runs no "
            "on_commit callback there, so the task could not be sent when the key row "
            "commits. Use transaction.atomic() instead."
        )
    with transaction.atomic(using=plan.alias, savepoint=False):
        generation = _claim_key(connection, plan)
        if generation is not None:
            transaction.on_commit(
                functools.partial(_send, plan, generation), using=plan.alias
            )
    return generation is not None


async def aenqueue_once(
    key: str,
    task: Any,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    policy: Policy = "queued",
    ttl: float | timedelta | None = None,
    window: float | timedelta | None = None,
    using: str | None = None,
) -> bool:
    """:func:`enqueue_once` from async code, run in Django's thread for the ORM (as the
    async ORM calls are). Outside a transaction there, it is one of its own: the key row
    commits and the task is sent before it returns."""
    return await sync_to_async(enqueue_once)(
        key, task, args, kwargs, policy=policy, ttl=ttl, window=window, using=using
    )


def unique_task(func: Callable[..., R]) -> Callable[..., R | None]:
    """Let :func:`enqueue_once` send this task: its runs take the key's slots.

    Placed under the task decorator (``@app.task`` / ``@shared_task`` / ``@task()`` on
    top). A run sent by enqueue_once starts by taking the key's running slot (with
    ``"one_running_one_queued"``, waiting for the running run to end first; with
    ``"debounce"``, returning None without running the body if a later enqueue
    superseded it) and gives it back when the body returns or raises. A run not sent by
    enqueue_once runs the body as usual. Raises TypeError for an ``async def`` function
    or one with a parameter named ``distlock_unique``.
    """
    if _is_task(func):
        raise TypeError(
            "@unique_task must be placed under the task decorator (the task decorator "
            "goes on top), so that the worker runs the wrapped function"
        )
    if iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
        raise TypeError(
            f"@unique_task cannot guard {func.__qualname__}(), an async function: its "
            "runs are sync (a task runner calls the function and gets a coroutine)"
        )
    signature = inspect.signature(func)
    if UNIQUE_KWARG in signature.parameters:
        raise TypeError(
            f"{func.__qualname__}(): the parameter name {UNIQUE_KWARG!r} is reserved: "
            "enqueue_once passes it to the wrapper"
        )

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> R | None:
        meta = kwargs.pop(UNIQUE_KWARG, None)
        if meta is None:
            return func(*args, **kwargs)
        run = _Run(meta)
        if not run.start():
            return None
        try:
            return func(*args, **kwargs)
        finally:
            run.end()

    # The signature the task runners check calls against: the function's own, plus the
    # keyword enqueue_once passes (Celery refuses an unexpected keyword at send time).
    params = list(signature.parameters.values())
    extra = inspect.Parameter(UNIQUE_KWARG, inspect.Parameter.KEYWORD_ONLY, default=None)
    at = next(
        (i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD),
        len(params),
    )
    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*params[:at], extra, *params[at:]]
    )
    del wrapper.__wrapped__
    wrapper._distlock_unique = True  # type: ignore[attr-defined]
    return wrapper


# -- enqueueing ---------------------------------------------------------------------------


class _Plan:
    """One enqueue_once call's arguments, checked (TypeError/ValueError) before anything
    is written."""

    def __init__(
        self, key: object, task: object, args: object, kwargs: object, policy: object,
        ttl: object, window: object, using: object,
    ) -> None:
        self.key = check_name(key)
        self.task: Any = task
        self.celery = _check_task(task)
        if isinstance(args, str | bytes) or not isinstance(args, Sequence):
            raise TypeError(f"args must be a list or tuple, not {type(args).__name__}")
        self.args = tuple(args)
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict or None, not {type(kwargs).__name__}")
        self.kwargs = dict(kwargs or {})
        if UNIQUE_KWARG in self.kwargs:
            raise TypeError(f"{UNIQUE_KWARG!r} is passed by enqueue_once; do not pass it")
        if not isinstance(policy, str):
            raise TypeError(f"policy must be a str, not {type(policy).__name__}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; not {policy!r}")
        self.policy = policy
        self.ttl_us = round(check_ttl(ttl) * 1e6)
        if policy == "debounce":
            if window is None:
                raise ValueError("policy 'debounce' needs window= (seconds to wait for more)")
            seconds = check_seconds(window, "window")
            if seconds <= 0:
                raise ValueError(f"window must be more than 0 s, not {seconds:g}")
            self.window: float = seconds
        elif window is not None:
            raise ValueError(f"window= is for policy 'debounce', not {policy!r}")
        else:
            self.window = 0.0
        if using is None:
            from distlock.models import TaskKey

            using = router.db_for_write(TaskKey)
        self.alias = check_using(using)
        self.task_name = _task_name(task)[:HOLDER_LENGTH]


def _claim_key(connection: BaseDatabaseWrapper, plan: _Plan) -> int | None:
    """Upsert and lock the key row in the current transaction; the generation to send,
    or None if a task of the key covers this enqueue."""
    from distlock.backends import backend_for

    backend = backend_for(connection)
    with connection.cursor() as cursor:
        # A new key row's generations start at the database clock (µs), not at 0: a key
        # that distlock_purge deleted and that comes back must not send a generation that
        # an old message of it, still in a queue, carries (that run would pass for the
        # latest). Each send adds 1 and takes far longer than a µs (the row lock orders
        # them), so a row's generations stay below the clock of its last send, and the
        # clock when the key comes back is past that (unless the server's clock is set
        # back by more than the key was idle: docs/decisions.md).
        cursor.execute(
            backend.upsert_locking(
                TABLE, "(name, task, policy, generation, ttl_us, running_owner)",
                f"VALUES (%s, %s, %s, {backend.now_sql()}, %s, '')", key="name",
                touch="generation",
            ),
            [plan.key, plan.task_name, plan.policy, plan.ttl_us],
        )
        # The clock is read after the row lock is held: a wait for it cannot age it.
        cursor.execute(
            f"SELECT generation, queued_until_us, running_until_us, {backend.now_sql()} "
            f"FROM {TABLE} WHERE name = %s{backend.for_update}",
            [plan.key],
        )
        generation, queued_until, running_until, now = cursor.fetchone()
        if _covered(plan.policy, now, queued_until, running_until):
            return None
        generation += 1
        queued_until = now + plan.ttl_us + round(plan.window * 1e6)
        cursor.execute(
            f"UPDATE {TABLE} SET task = %s, policy = %s, generation = %s, ttl_us = %s, "
            "enqueued_us = %s, queued_until_us = %s WHERE name = %s",
            [plan.task_name, plan.policy, generation, plan.ttl_us, now, queued_until,
             plan.key],
        )
    return int(generation)


def _covered(policy: str, now: int, queued_until: int | None, running_until: int | None) -> bool:
    """Does a task of the key already cover an enqueue at ``now``? (Slots end by the
    database clock: a slot whose end has passed covers nothing.)"""
    queued = queued_until is not None and queued_until > now
    running = running_until is not None and running_until > now
    if policy == "queued":
        return queued or running
    if policy == "one_running_one_queued":
        return queued
    return False  # debounce: every enqueue sends, the latest one runs


def _send(plan: _Plan, generation: int) -> None:
    """Send the task (on commit). If the broker refuses it, the key's queued slot is given
    back, so the key is not blocked until its ttl by a task that was never sent."""
    meta = [plan.key, generation, plan.alias]
    kwargs = {**plan.kwargs, UNIQUE_KWARG: meta}
    try:
        if plan.celery:
            plan.task.apply_async(plan.args, kwargs, countdown=plan.window or None)
        else:
            task = plan.task
            if plan.window:
                task = task.using(run_after=timezone.now() + timedelta(seconds=plan.window))
            task.enqueue(*plan.args, **kwargs)
    except BaseException:
        with connections[plan.alias].cursor() as cursor:
            cursor.execute(
                f"UPDATE {TABLE} SET queued_until_us = NULL "
                "WHERE name = %s AND generation = %s",
                [plan.key, generation],
            )
        raise


def _is_task(task: object) -> bool:
    """A Celery task (or its shared_task Proxy) or a Django task, not a plain function."""
    return (hasattr(task, "apply_async") and hasattr(task, "run")) or (
        hasattr(task, "enqueue") and hasattr(task, "func")
    )


def _check_task(task: object) -> bool:
    """True for a Celery task, False for a Django task; TypeError if it is neither or
    its function does not carry @unique_task."""
    if hasattr(task, "apply_async") and hasattr(task, "run"):
        function, celery = task.run, True
    elif hasattr(task, "enqueue") and hasattr(task, "func"):
        function, celery = task.func, False
    else:
        raise TypeError(
            f"task must be a Celery task or a Django task, not {type(task).__name__}"
        )
    if not getattr(function, "_distlock_unique", False):
        raise TypeError(
            f"task {_task_name(task)} does not carry @unique_task (put it under the "
            "task decorator): its runs would not take the key's slots"
        )
    return celery


def _task_name(task: Any) -> str:
    name = getattr(task, "module_path", None) or getattr(task, "name", None)
    return str(name or type(task).__name__)


# -- running ------------------------------------------------------------------------------


class _Run:
    """One run of a unique task in its worker: the key's slots taken and given back."""

    def __init__(self, meta: object) -> None:
        if not (isinstance(meta, list | tuple) and len(meta) == 3):
            raise TypeError(f"{UNIQUE_KWARG} must be [key, generation, alias], not {meta!r}")
        key, generation, alias = meta
        self.key = check_name(key)
        self.generation = int(generation)
        self.alias = check_using(alias)
        self.owner = uuid.uuid4().hex
        self.holds = False

    def start(self) -> bool:
        """Take the running slot (waiting for it if the policy says so); False if this
        run must skip its body."""
        pause = POLL_FIRST
        while True:
            decision = self._try()
            if decision != "wait":
                return decision == "run"
            time.sleep(pause)
            pause = min(pause * 2, POLL_MOST)

    def _try(self) -> str:
        """One look at the key row, in a transaction of its own: "run", "skip" or "wait"."""
        from distlock.backends import backend_for

        connection = connections[self.alias]
        backend = backend_for(connection)
        with transaction.atomic(using=self.alias), connection.cursor() as cursor:
            cursor.execute(
                f"SELECT policy, generation, running_until_us, running_owner, "
                f"waiting_us, {backend.now_sql()} FROM {TABLE} "
                f"WHERE name = %s{backend.for_update}",
                [self.key],
            )
            row = cursor.fetchone()
            if row is None:
                return "run"  # the key row is gone (deleted by hand): nothing to take
            policy, latest, running_until, running_owner, waiting, now = row
            if policy == "debounce" and self.generation != latest:
                logger.debug("task key %s: generation %s superseded by %s: skipped",
                             self.key, self.generation, latest)
                return "skip"
            if (
                policy == "one_running_one_queued"
                and running_until is not None and running_until > now
                and running_owner != self.owner
            ):
                if waiting is None:
                    cursor.execute(
                        f"UPDATE {TABLE} SET waiting_us = %s WHERE name = %s", [now, self.key]
                    )
                return "wait"
            cursor.execute(
                f"UPDATE {TABLE} SET running_until_us = {backend.now_sql()} + ttl_us, "
                "running_owner = %s, started_us = %s, waiting_us = NULL, "
                "queued_until_us = CASE WHEN generation = %s THEN NULL "
                "ELSE queued_until_us END WHERE name = %s",
                [self.owner, now, self.generation, self.key],
            )
            self.holds = True
            return "run"

    def end(self) -> None:
        """Give the running slot back, if it is still this run's (one that outlived its
        ttl may have lost it to the next run)."""
        if not self.holds:
            return
        with connections[self.alias].cursor() as cursor:
            cursor.execute(
                f"UPDATE {TABLE} SET running_until_us = NULL, running_owner = '' "
                "WHERE name = %s AND running_owner = %s",
                [self.key, self.owner],
            )


# -- purging ------------------------------------------------------------------------------

#: A key row is idle when every time it holds (both slots' ends, the last send, the last
#: start, a waiting run's start) is at least ``idle`` µs (the parameter) before the
#: database clock: no slot of it counts, and no enqueue or run touched it since.
_IDLE = " AND ".join(
    f"COALESCE({column}, 0) <= {{now}} - %s"
    for column in ("queued_until_us", "running_until_us", "enqueued_us", "started_us",
                   "waiting_us")
)


def purge_task_keys(*, idle: Seconds = timedelta(days=1), using: str | None = None) -> int:
    """Delete the key rows of :func:`enqueue_once` that have been idle for at least
    ``idle`` (by the database clock); return how many.

    Key rows stay after their slots end (the next enqueue of the key finds its policy and
    generation there), so a site that makes keys of ids grows one row per id for good;
    ``distlock_purge`` calls this with its ``--idle``. A key that comes back after its row
    was deleted starts again with nothing queued or running, and at a generation no
    earlier message of it carries (new rows start at the database clock, _claim_key), so
    a debounced message still in a queue from before the purge skips its body. A row that
    an enqueue or a run touches while the purge runs is kept: the delete checks the same
    condition again on the row it deletes. Deletes in batches of PURGE_BATCH names, one
    short transaction each (distlock/core/batches.py). Raises TypeError/ValueError for a bad
    ``idle`` or ``using`` (nothing is deleted).
    """
    from distlock.core.batches import in_batches

    seconds = check_seconds(idle, "idle")
    if seconds < 0:
        raise ValueError(f"idle must not be negative, not {seconds}")
    alias = check_using(using)
    idle_us = round(seconds * 1e6)

    def batch() -> tuple[int, bool]:
        return _purge_batch(alias, idle_us, PURGE_BATCH)

    return sum(deleted for deleted, _ in in_batches(alias, batch))


def count_idle_task_keys(idle_us: int, using: str) -> int:
    """How many key rows :func:`purge_task_keys` would delete now (its dry run)."""
    with connections[using].cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {TABLE} WHERE {_idle(using)}", [idle_us] * 5)
        return int(cursor.fetchone()[0])


def _idle(alias: str) -> str:
    from distlock.backends import backend_for

    return _IDLE.format(now=backend_for(connections[alias]).now_sql())


def _purge_batch(alias: str, idle_us: int, size: int) -> tuple[int, bool]:
    """Delete up to ``size`` idle key rows; (rows deleted, whether there may be more).
    The names are read first, then deleted under the same condition, which the delete
    evaluates on each row it locks, so a row claimed in between stays."""
    idle = _idle(alias)
    with connections[alias].cursor() as cursor:
        cursor.execute(
            f"SELECT name FROM {TABLE} WHERE {idle} ORDER BY name LIMIT {int(size)}",
            [idle_us] * 5,
        )
        names = [name for (name,) in cursor.fetchall()]
        if not names:
            return 0, False
        marks = ", ".join(["%s"] * len(names))
        cursor.execute(
            f"DELETE FROM {TABLE} WHERE name IN ({marks}) AND {idle}", [*names, *[idle_us] * 5]
        )
        return cursor.rowcount, len(names) == size
