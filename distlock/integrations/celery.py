"""Celery integration: run a task body under a distlock lease.

Placed *under* the task decorator (Celery applies decorators bottom-up, and the task
decorator must see the final function)::

    @shared_task(bind=True, acks_late=True)
    @locked_task("invoice:{invoice_id}", ttl=30, on_contention="retry")
    def charge(self, invoice_id, *, lease):
        invoice = Invoice.objects.get(pk=invoice_id)
        ...
        invoice.save(fence=lease)

Why the lock is taken when the task *runs* (in the worker), not when it is queued: a
broker redelivers a message (``acks_late`` after a lost worker, a Redis visibility
timeout) without going through ``apply_async`` again, and the redelivered copy has the
same task id. So every run acquires its own lease with a fresh owner id, and two copies
of one task are two contenders like any others.

This module imports Celery; the rest of distlock never does (Celery is an optional
extra: ``pip install django-distlock[celery]``).
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from celery import Task, current_task
from celery.local import Proxy
from celery.signals import before_task_publish

from distlock.core.permits import check_permits
from distlock.integrations.policies import (
    Alias,
    Contention,
    ContentionPolicy,
    LockContended,
    Raise,
    Retry,
    Skip,
    Wait,
    task_lock_busy,
)
from distlock.integrations.taskfunc import TaskFunction, check_options, run_locked
from distlock.integrations.unique import (
    aenqueue_once,
    enqueue_once,
    purge_task_keys,
    unique_task,
)
from distlock.validation import Seconds, check_ttl

if TYPE_CHECKING:
    from distlock.core.leases import Lease, LostCallback

__all__ = [
    "ContentionPolicy", "LockContended", "Raise", "Retry", "Skip", "Wait", "aenqueue_once",
    "enqueue_once", "locked_task", "purge_task_keys", "task_lock_busy", "unique_task",
    "visibility_timeout",
]

logger = logging.getLogger("distlock.integrations.celery")

R = TypeVar("R")

# How long a retried run waits for its own previous run to release (see wrapper).
RETRY_GRACE = 2.0

# The message header naming the lease (its owner id) that the run queueing a retry of
# itself still holds; the retried run reads it back as ``task.request.distlock_retry_of``.
RETRY_OF_HEADER = "distlock_retry_of"

# Transports that redeliver an unacknowledged message after a visibility timeout, with
# kombu's default for it (seconds).
_VISIBILITY_DEFAULTS = {"redis": 3600.0, "rediss": 3600.0, "sentinel": 3600.0, "sqs": 1800.0}

# The locked task running in this thread and its lease: (task id, lease).
_running: contextvars.ContextVar[tuple[str, Lease] | None] = contextvars.ContextVar(
    "distlock_celery_running", default=None
)


def visibility_timeout(app: Any) -> float | None:
    """The broker's redelivery timeout for unacknowledged messages, or None if it has none.

    Redis and SQS hand an unacknowledged message to another worker once this many seconds
    have passed, while the first copy may still be running.
    """
    options = app.conf.broker_transport_options or {}
    if options.get("visibility_timeout") is not None:
        return float(options["visibility_timeout"])
    url = app.conf.broker_url or ""
    scheme = urlsplit(str(url).split(";")[0]).scheme.split("+")[0]
    return _VISIBILITY_DEFAULTS.get(scheme)


def locked_task(
    name: str | Callable[..., str],
    *,
    ttl: Seconds | None = None,
    on_contention: ContentionPolicy | Alias = "retry",
    timeout: Seconds | None = None,
    countdown: Seconds = 1.0,
    max_retries: int | None = None,
    jitter: bool | Seconds = True,
    using: str | None = None,
    auto_renew: bool = False,
    on_lost: LostCallback | None = None,
    limit: int | None = None,
) -> Callable[[Callable[..., R]], Callable[..., R | None]]:
    """Run each execution of a Celery task under lock ``name``.

    With ``limit=N`` it runs under a permit of semaphore ``name`` instead (at most N runs
    at once by the database clock; docs/semaphores.md): contention means all N permits
    are held, and the lease handed to the body is the permit.

    ``name`` is a ``str.format`` template over the task function's parameters
    (``"invoice:{invoice_id}"``) or a callable taking the same arguments (without the task
    and the lease) and returning the name. It is computed once per execution.

    The lease reaches the body as the keyword-only parameter ``lease`` if the function
    declares one (it is hidden from the task's signature, so callers cannot pass it and
    Celery still checks call arguments), and through :func:`distlock.current_lease`.
    It is released when the body returns or raises (``self.retry()`` included, so the
    retried run gets a new lease with a higher token).

    When the lock is held by someone else, after trying for ``timeout`` seconds (default:
    once; for ``Wait``: up to ``ttl``), ``on_contention`` decides:

    - :class:`Retry` (``"retry"``, the default): ``task.retry(countdown=countdown +
      jitter)``; ``max_retries`` (default: the task's) bounds it, then
      :class:`LockContended` is raised;
    - :class:`Skip` (``"skip"``): the body does not run, the task returns None;
    - :class:`Wait` (``"wait"``): keep waiting up to ``timeout`` seconds, then raise
      :class:`~distlock.LockTimeout` (a task cannot wait forever: it holds a pool slot);
    - :class:`Raise` (``"raise"``): raise :class:`LockContended` at once.

    With an alias, ``countdown``, ``max_retries`` and ``jitter`` complete ``Retry``; a
    policy object carries its own options (passing them here as well is a TypeError).
    Every contention is logged on the ``distlock.integrations.celery`` logger and sent as
    :data:`task_lock_busy`. ``auto_renew`` renews the lease in a helper thread for long
    tasks; a TTL longer than the broker's visibility timeout is reported with a warning.
    """
    wait, policy = check_options(
        name, ttl=ttl, timeout=timeout, on_contention=on_contention, countdown=countdown,
        max_retries=max_retries, jitter=jitter,
    )
    permits = None if limit is None else check_permits(limit, "limit")

    def decorate(func: Callable[..., R]) -> Callable[..., R | None]:
        # A Proxy is what @shared_task returns before the app is finalized; checking it
        # first keeps isinstance() from evaluating (and registering) it here.
        if isinstance(func, (Proxy, Task)):
            raise TypeError(
                "@locked_task must be placed under @shared_task/@app.task (the task "
                "decorator goes on top), so that the worker runs the locked function"
            )
        function = TaskFunction(func, name)
        warned: set[str] = set()

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> R | None:
            function.refuse_lease(kwargs)
            task = args[0] if args and isinstance(args[0], Task) else _running_task()
            request = getattr(task, "request", None)
            task_id = getattr(request, "id", None)
            retries = int(getattr(request, "retries", 0) or 0)
            bound = task is not None and bool(args) and args[0] is task
            lease_name = function.lock_name(args, kwargs, skip=1 if bound else 0)
            seconds = check_ttl(ttl)
            if task is not None and task.name not in warned:
                warned.add(task.name)
                _warn_visibility(task, seconds, auto_renew)
            limit = policy.limit(seconds, wait)
            holder = f"task={getattr(task, 'name', func.__qualname__)}[{task_id}]"
            if retries:
                holder += f" retry={retries}"
            if request is not None and (request.delivery_info or {}).get("redelivered"):
                holder += " redelivered"

            def body(lease: Lease) -> R:
                with _run(task_id, lease):
                    result: R = function.call(args, kwargs, lease)
                    return result

            # Celery queues a retry before the run asking for it has left the body and
            # released: a retried run meeting the lease of that run (named in its message)
            # gives the release a moment before calling the lock contended.
            previous = getattr(request, RETRY_OF_HEADER, None) if retries else None
            for attempt in (limit, max(limit, RETRY_GRACE)):
                ran, value = run_locked(
                    body, lease_name, ttl=seconds, timeout=attempt, using=using,
                    holder=holder, auto_renew=auto_renew, on_lost=on_lost, permits=permits,
                )
                if ran:
                    return value
                if not _held_by(lease_name, previous, using):
                    break
            policy.contended(Contention(
                task, lease_name, limit, task_id, retries,
                retry=None if task is None else task.retry,
            ))
            return None  # the policy skipped the body (any other decision raised)

        function.present(wrapper)
        return wrapper

    return decorate


@contextmanager
def _run(task_id: str | None, lease: Lease) -> Iterator[None]:
    """Mark ``lease`` as held by the run of ``task_id`` in this thread (see _mark_retry)."""
    if task_id is None:
        yield
        return
    token = _running.set((task_id, lease))
    try:
        yield
    finally:
        _running.reset(token)


@before_task_publish.connect
def _mark_retry(headers: dict[str, Any] | None = None, **kwargs: Any) -> None:
    """Name the lease a run holds in the message of its own retry (same task id)."""
    running = _running.get()
    if headers is None or running is None or headers.get("id") != running[0]:
        return
    headers[RETRY_OF_HEADER] = running[1].owner


def _held_by(name: str, owner: str | None, using: str | None) -> bool:
    """True if lock ``name`` is still held by the grant of ``owner`` (a run's own previous
    run), or was freed since the try that failed: worth one more try, then."""
    from distlock.models import Lock
    from distlock.validation import check_using

    if not owner:
        return False
    return Lock.objects.using(check_using(using)).filter(name=name, owner__in=[owner, ""]).exists()


def _running_task() -> Task[Any, Any] | None:
    """The task being executed in this thread (for tasks declared without bind=True)."""
    # A Proxy: unwrapped to see None when no task runs.
    running: Task[Any, Any] | None = current_task._get_current_object()  # type: ignore[attr-defined]
    return running


def _warn_visibility(task: Task[Any, Any], ttl: float, auto_renew: bool) -> None:
    """Warn once per task when the broker may redeliver it while it still holds the lock.

    A Redis/SQS message unacknowledged for longer than the visibility timeout is handed
    to another worker. A lease that outlives that timeout (a long TTL, or auto-renewal)
    means the redelivered copy meets the lock and, with "retry" or "wait", runs again
    once the first copy finishes: mutual exclusion holds, but the work is done twice.
    """
    try:
        limit = visibility_timeout(task.app)
    except Exception:  # noqa: BLE001 - a warning must never break the task
        return
    if limit is None:
        return
    if ttl > limit:
        logger.warning(
            "task %s: lock ttl %.0f s is longer than the broker visibility timeout %.0f s; "
            "an acks_late message can be redelivered while this run still holds the "
            "lock%s", task.name, ttl, limit,
            " (and auto_renew can hold it longer still)" if auto_renew else "",
        )
