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

import functools
import inspect
import logging
import random
import string
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import urlsplit

from celery import Task, current_task
from celery.local import Proxy
from django.dispatch import Signal

from distlock.exceptions import LockTimeout
from distlock.validation import Seconds, check_name, check_seconds, check_timeout, check_ttl

if TYPE_CHECKING:
    from distlock.leases import LostCallback

__all__ = ["LockContended", "locked_task", "task_lock_busy", "visibility_timeout"]

logger = logging.getLogger("distlock.celery")

R = TypeVar("R")
Policy = Literal["skip", "retry", "wait", "raise"]
POLICIES = ("skip", "retry", "wait", "raise")

#: Sent in the worker whenever a locked task found its lock held and did not run its
#: body this time: sender=the task; name (lock name), policy, task_id, retries (the
#: task's retry count so far), countdown (seconds until the retry, or None).
task_lock_busy = Signal()

# How long a retried run waits for its own previous run to release (see wrapper).
RETRY_GRACE = 2.0

# Transports that redeliver an unacknowledged message after a visibility timeout, with
# kombu's default for it (seconds).
_VISIBILITY_DEFAULTS = {"redis": 3600.0, "rediss": 3600.0, "sentinel": 3600.0, "sqs": 1800.0}


class LockContended(LockTimeout):
    """A locked task's lock was held by someone else and the policy gave up.

    Raised by ``on_contention="raise"``, and by ``"retry"`` once the retries are used up.
    A :class:`~distlock.LockTimeout`, so code that handles lock timeouts handles it too.
    """

    def __init__(self, name: str, timeout: float | None, task_id: str | None) -> None:
        super().__init__(name, timeout)
        self.task_id = task_id
        self.args = (f"task {task_id}: lock {name!r} is held by someone else",)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.timeout, self.task_id))


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


def _template_fields(name: str) -> set[str]:
    fields = {
        field.split(".")[0].split("[")[0]
        for _, field, _, _ in string.Formatter().parse(name)
        if field is not None
    }
    if "" in fields:
        raise ValueError("lock name template fields must be named, e.g. {invoice_id}")
    return fields


def locked_task(
    name: str | Callable[..., str],
    *,
    ttl: Seconds | None = None,
    on_contention: Policy = "retry",
    timeout: Seconds | None = None,
    countdown: Seconds = 1.0,
    max_retries: int | None = None,
    jitter: bool | Seconds = True,
    using: str | None = None,
    auto_renew: bool = False,
    on_lost: LostCallback | None = None,
) -> Callable[[Callable[..., R]], Callable[..., R | None]]:
    """Run each execution of a Celery task under lock ``name``.

    ``name`` is a ``str.format`` template over the task function's parameters
    (``"invoice:{invoice_id}"``) or a callable taking the same arguments (without the task
    and the lease) and returning the name. It is computed once per execution.

    The lease reaches the body as the keyword-only parameter ``lease`` if the function
    declares one (it is hidden from the task's signature, so callers cannot pass it and
    Celery still checks call arguments), and through :func:`distlock.current_lease`.
    It is released when the body returns or raises (``self.retry()`` included, so the
    retried run gets a new lease with a higher token).

    When the lock is held by someone else, after trying for ``timeout`` seconds (default:
    once; for ``"wait"``: up to ``ttl``):

    - ``"retry"``: ``task.retry(countdown=countdown + jitter)``; ``max_retries`` (default:
      the task's) bounds it, then :class:`LockContended` is raised;
    - ``"skip"``: the body does not run, the task returns None;
    - ``"wait"``: keep waiting up to ``timeout`` seconds, then raise
      :class:`~distlock.LockTimeout` (a task cannot wait forever: it holds a pool slot);
    - ``"raise"``: raise :class:`LockContended` at once.

    Every contention is logged on the ``distlock.celery`` logger and sent as
    :data:`task_lock_busy`. ``auto_renew`` renews the lease in a helper thread for long
    tasks; a TTL longer than the broker's visibility timeout is reported with a warning.
    """
    if on_contention not in POLICIES:
        raise ValueError(f"on_contention must be one of {POLICIES}, not {on_contention!r}")
    if isinstance(name, str):
        if not name:
            raise ValueError("lock name template must not be empty")
        fields = _template_fields(name)
    elif callable(name):
        fields = set()
    else:
        raise TypeError(
            f"lock name must be a str template or a callable, not {type(name).__name__}"
        )
    if ttl is not None:
        check_ttl(ttl)
    wait = check_timeout(timeout)
    pause = check_seconds(countdown, "countdown")
    if pause < 0:
        raise ValueError(f"countdown must not be negative, not {pause}")
    if isinstance(jitter, bool):
        spread = pause if jitter else 0.0
    else:
        spread = check_seconds(jitter, "jitter")
        if spread < 0:
            raise ValueError(f"jitter must not be negative, not {spread}")
    if max_retries is not None and (
        isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0
    ):
        raise ValueError(f"max_retries must be a non-negative int or None, not {max_retries!r}")

    def decorate(func: Callable[..., R]) -> Callable[..., R | None]:
        # A Proxy is what @shared_task returns before the app is finalized; checking it
        # first keeps isinstance() from evaluating (and registering) it here.
        if isinstance(func, (Proxy, Task)):
            raise TypeError(
                "@locked_task must be placed under @shared_task/@app.task (the task "
                "decorator goes on top), so that the worker runs the locked function"
            )
        signature = inspect.signature(func)
        params = signature.parameters
        missing = fields - set(params)
        if missing:
            raise ValueError(
                f"lock name {name!r} uses {sorted(missing)}, which "
                f"{func.__qualname__}() has no parameters for"
            )
        takes_lease = "lease" in params
        if takes_lease and params["lease"].kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(
                f"{func.__qualname__}(): 'lease' must be a keyword-only parameter "
                "(def task(self, ..., *, lease)); distlock passes it, callers never do"
            )
        public = signature.replace(
            parameters=[p for p in params.values() if p.name != "lease"]
        )
        warned: set[str] = set()

        def lock_name(task: Task | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
            if callable(name) and not isinstance(name, str):
                call_args = args[1:] if task is not None and args and args[0] is task else args
                return check_name(name(*call_args, **kwargs))
            bound = public.bind(*args, **kwargs)
            bound.apply_defaults()
            return check_name(name.format(**bound.arguments))

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> R | None:
            # Imported here: a tasks module importing this one may load before Django's
            # app registry is ready, and distlock.locks imports the Lock model.
            from distlock.locks import lock

            if "lease" in kwargs:
                raise TypeError("the lease is passed by distlock; do not pass 'lease' yourself")
            task = args[0] if args and isinstance(args[0], Task) else _running_task()
            request = getattr(task, "request", None)
            task_id = getattr(request, "id", None)
            retries = int(getattr(request, "retries", 0) or 0)
            lease_name = lock_name(task, args, kwargs)
            seconds = check_ttl(ttl)
            if task is not None and task.name not in warned:
                warned.add(task.name)
                _warn_visibility(task, seconds, auto_renew)
            limit = wait if wait is not None else (seconds if on_contention == "wait" else 0)
            holder = f"task={getattr(task, 'name', func.__qualname__)}[{task_id}]"
            if retries:
                holder += f" retry={retries}"
            if request is not None and (request.delivery_info or {}).get("redelivered"):
                holder += " redelivered"
            options = {
                "ttl": seconds, "using": using, "holder": holder, "auto_renew": auto_renew,
                "on_lost": on_lost,
            }
            guard = lock(lease_name, timeout=limit, **options)
            try:
                lease = guard.__enter__()
            except LockTimeout:
                if not (retries and _held_by(lease_name, task_id, using)):
                    return _contended(task, lease_name, limit, task_id, retries)
                # Celery queues a retry before the previous run has left the body and
                # released; give that release a moment before calling the lock contended.
                guard = lock(lease_name, timeout=max(limit, RETRY_GRACE), **options)
                try:
                    lease = guard.__enter__()
                except LockTimeout:
                    return _contended(task, lease_name, limit, task_id, retries)
            try:
                if takes_lease:
                    return func(*args, lease=lease, **kwargs)
                return func(*args, **kwargs)
            finally:
                guard.__exit__(None, None, None)

        def _contended(
            task: Task | None, lease_name: str, limit: float, task_id: str | None,
            retries: int,
        ) -> None:
            if on_contention == "retry" and task is not None:
                delay = pause + random.uniform(0, spread)
                logger.info(
                    "task %s: lock %r is busy; retry %d in %.2f s",
                    task_id, lease_name, retries + 1, delay,
                )
                task_lock_busy.send(
                    sender=task, name=lease_name, policy="retry", task_id=task_id,
                    retries=retries, countdown=delay,
                )
                options: dict[str, Any] = {"countdown": delay}
                if max_retries is not None:
                    options["max_retries"] = max_retries
                raise task.retry(exc=LockContended(lease_name, limit, task_id), **options)
            logger.warning(
                "task %s: lock %r is busy; %s", task_id, lease_name,
                {"skip": "skipped, the task did not run",
                 "wait": f"gave up after waiting {limit} s"}.get(on_contention, "raising"),
            )
            task_lock_busy.send(
                sender=task, name=lease_name, policy=on_contention, task_id=task_id,
                retries=retries, countdown=None,
            )
            if on_contention == "skip":
                return None
            if on_contention == "wait":
                raise LockTimeout(lease_name, limit)
            raise LockContended(lease_name, limit, task_id)

        wrapper.__signature__ = public  # type: ignore[attr-defined]
        # functools.wraps set __wrapped__; tools that follow it would show (and Celery's
        # newer argument check would read) the signature with 'lease' in it.
        del wrapper.__wrapped__  # type: ignore[attr-defined]
        return wrapper

    return decorate


def _held_by(name: str, task_id: str | None, using: str | None) -> bool:
    """True if lock ``name`` is held by a run of task ``task_id`` (per its holder text)."""
    from distlock.models import Lock
    from distlock.validation import check_using

    if not task_id:
        return False
    holder = (
        Lock.objects.using(check_using(using)).filter(name=name)
        .values_list("holder", flat=True).first()
    )
    return bool(holder) and f"[{task_id}]" in holder


def _running_task() -> Task | None:
    """The task being executed in this thread (for tasks declared without bind=True)."""
    return current_task._get_current_object()  # a Proxy: unwrap it to see None


def _warn_visibility(task: Task, ttl: float, auto_renew: bool) -> None:
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
