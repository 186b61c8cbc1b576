"""Django's Tasks framework: run a task body under a distlock lease.

Placed *under* ``@task`` (the task decorator goes on top: it must see the final function,
and it is what the worker imports and runs)::

    from django.tasks import task      # Django 6; on 5.2: from django_tasks import task

    @task()
    @locked_task("invoice:{invoice_id}", ttl=30, on_contention="retry")
    def charge(invoice_id, *, lease):
        invoice = Invoice.objects.get(pk=invoice_id)
        ...
        invoice.save(fence=lease)

    @task(takes_context=True)
    @locked_task("report:{customer_id}", ttl=60, on_contention="skip")
    def rebuild(context, customer_id, *, lease): ...

The semantics are :mod:`distlock.celery`'s (the shared part is
:mod:`distlock.integrations.taskfunc`, the policies :mod:`distlock.integrations.policies`):
the lock is taken when the task *runs* in a
worker, not when it is enqueued, with a new owner id for every run; the lease reaches the
body as the keyword-only ``lease`` (hidden from the task's signature) and through
:func:`distlock.current_lease`; it is released when the body returns or raises.

**Retry re-enqueues** the task (a new TaskResult, same arguments, same queue and
priority) with ``run_after`` = now + countdown (+ jitter). That needs a backend that can
defer (``supports_defer``: django-tasks-db's ``DatabaseBackend`` can, Django's
``ImmediateBackend`` cannot). Where it cannot, a contended run fails with
:class:`CannotRequeue`, a :class:`LockContended` whose message says so and what to use
instead. This is checked when the lock is found busy, not at decoration: the backend is
chosen by ``@task(backend=...)``, which is applied *after* this decorator, and can be
changed per call with ``.using(backend=...)``; so a Retry task still runs on the immediate
backend (in tests) as long as its lock is free.

The run that requeued itself ends *successfully*, returning None, as a skipped run does:
Django Tasks has no "retrying" state, and a FAILED result would be logged as an error
with a traceback for routine contention, and re-run by anything that re-runs failed tasks
(a second copy). The new result's id is logged on ``distlock.integrations.tasks``. Its retry count
travels as the keyword argument ``distlock_retries`` (a requeue is a new TaskResult, so
nothing else carries it); the wrapper takes it off before calling the function.
``max_retries`` defaults to 3 (Celery's default: a Django task has no setting of its
own); past it, the run fails with :class:`LockContended`.

A worker killed mid-task (SIGKILL, OOM) is not redelivered by django-tasks-db: its result
stays RUNNING. Its lease runs out at its TTL; the next run of the lock gets a higher token,
and a write the dead (or paused) run makes with its stale lease is refused by fencing.

An ``async def`` task function is run under :class:`~distlock.alock` (waiting does not
block the event loop; auto-renewal is an asyncio task); the contention policy, which may
send signals and enqueue, runs through ``sync_to_async``.

Works with Django 6's ``django.tasks`` and, on Django 5.2, with the ``django-tasks``
backport (``pip install django-distlock[tasks]``); ``django.tasks`` is used whenever it
exists, as django-tasks-db does.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from contextvars import ContextVar
from datetime import timedelta
from importlib import import_module
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any, TypeVar

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.utils import timezone

from distlock.core.permits import check_permits

# The policies are this module's API too, named one by one as in distlock.celery: a star
# import would hide them from type checkers (mypy does not follow distlock.tasks' star
# import through a second one).
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
from distlock.integrations.taskfunc import TaskFunction, arun_locked, check_options, run_locked
from distlock.integrations.unique import (
    aenqueue_once,
    enqueue_once,
    purge_task_keys,
    unique_task,
)
from distlock.validation import Seconds, check_ttl

if TYPE_CHECKING:
    from distlock.core.leases import LostCallback

__all__ = [
    "CannotRequeue", "ContentionPolicy", "LockContended", "Raise", "Retry", "Skip", "Wait",
    "aenqueue_once", "enqueue_once", "locked_task", "purge_task_keys", "task_lock_busy",
    "unique_task",
]

logger = logging.getLogger("distlock.integrations.tasks")

R = TypeVar("R")

#: The keyword argument that carries a requeued run's retry count.
RETRIES_KWARG = "distlock_retries"
#: Retries of a contended run when the policy sets no ``max_retries`` (Celery's default).
DEFAULT_MAX_RETRIES = 3


def _framework() -> str:
    # django-tasks-db makes the same choice, so the worker and this module agree.
    if find_spec("django.tasks") is not None:
        return "django.tasks"
    if find_spec("django_tasks") is not None:
        return "django_tasks"
    raise ImportError(
        "distlock.tasks needs Django's Tasks framework: Django 6, or on Django 5.2 the "
        "django-tasks backport (pip install django-distlock[tasks])"
    )


#: The Tasks framework in use: "django.tasks" or "django_tasks" (import ``task`` from it).
FRAMEWORK = _framework()
_base = import_module(f"{FRAMEWORK}.base")
TaskContext: type[Any] = _base.TaskContext

# The result of the task this thread (or coroutine) is running, set when the worker
# announces it (task_started): a task declared without takes_context gets no context
# argument, and this is how its run finds its own TaskResult to requeue.
_started: ContextVar[Any] = ContextVar("distlock_tasks_started", default=None)


def _task_started(sender: Any, task_result: Any = None, **kwargs: Any) -> None:
    _started.set(task_result)


def _task_finished(sender: Any, task_result: Any = None, **kwargs: Any) -> None:
    _started.set(None)


_signals = import_module(f"{FRAMEWORK}.signals")
_signals.task_started.connect(_task_started, dispatch_uid="distlock.integrations.tasks.started")
_signals.task_finished.connect(_task_finished, dispatch_uid="distlock.integrations.tasks.finished")


class CannotRequeue(LockContended):
    """The lock was busy and ``on_contention`` is retry, but the task's backend cannot
    defer a task (``supports_defer`` is False, e.g. Django's ImmediateBackend)."""

    def __init__(self, name: str, timeout: float | None, task_id: str | None,
                 backend: str) -> None:
        super().__init__(name, timeout, task_id)
        self.backend = backend
        self.args = (
            f"task {task_id}: lock {name!r} is held by someone else, and "
            f"on_contention='retry' cannot requeue the task: its backend {backend} cannot "
            "defer a task (supports_defer is False). Use a backend that can (django-tasks-"
            "db's DatabaseBackend), or on_contention='wait' or 'skip'",
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.timeout, self.task_id, self.backend))


class _Requeued(Exception):
    """Ends a contended run whose task was queued again (caught by the wrapper)."""

    def __init__(self, result_id: str) -> None:
        super().__init__(result_id)
        self.result_id = result_id


class _Requeue:
    """Contention.retry for a Django task: enqueue it again, run_after a countdown."""

    def __init__(self, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 retries: int) -> None:
        self.task, self.args, self.kwargs, self.retries = task, args, kwargs, retries

    def __call__(self, *, exc: LockContended, countdown: float,
                 max_retries: int | None = None) -> BaseException:
        limit = DEFAULT_MAX_RETRIES if max_retries is None else max_retries
        if self.retries >= limit:
            return exc
        backend = self.task.get_backend()
        if not backend.supports_defer:
            kind = f"{backend.alias!r} ({type(backend).__name__})"
            return CannotRequeue(exc.name, exc.timeout, exc.task_id, kind)
        when = timezone.now() + timedelta(seconds=countdown)
        queued = self.task.using(run_after=when).enqueue(
            *self.args, **self.kwargs, **{RETRIES_KWARG: self.retries + 1}
        )
        return _Requeued(str(queued.id))


# The options of distlock.celery's locked_task, spelled out again: a public signature has
# to be written where help(), IDEs and type checkers read it. What they mean is shared
# (check_options, TaskFunction, run_locked, the policies).
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
) -> Callable[[Callable[..., R]], Callable[..., Any]]:
    """Run each execution of a Django task under lock ``name``.

    With ``limit=N`` it runs under a permit of semaphore ``name`` instead (at most N runs
    at once by the database clock; docs/semaphores.md); the lease is the permit.

    ``name`` is a ``str.format`` template over the task function's parameters
    (``"invoice:{invoice_id}"``; with ``takes_context`` the context is a parameter too)
    or a callable taking the task's arguments (without the context and the lease) and
    returning the name. It is computed once per execution.

    The lease reaches the body as the keyword-only parameter ``lease`` if the function
    declares one (hidden from the task's signature) and through
    :func:`distlock.current_lease`; it is released when the body returns or raises.

    When the lock is held by someone else, after trying for ``timeout`` seconds (default:
    once; for ``Wait``: up to ``ttl``), ``on_contention`` decides:

    - :class:`Retry` (``"retry"``, the default): enqueue the task again to run after
      ``countdown`` (+ ``jitter``) seconds, at most ``max_retries`` times (default 3),
      then fail with :class:`LockContended`; this run returns None. A backend that cannot
      defer makes it fail with :class:`CannotRequeue` (see the module docstring);
    - :class:`Skip` (``"skip"``): the body does not run, the task returns None;
    - :class:`Wait` (``"wait"``): keep waiting up to ``timeout`` seconds, then raise
      :class:`~distlock.LockTimeout` (a worker runs one task at a time: it cannot wait
      forever);
    - :class:`Raise` (``"raise"``): raise :class:`LockContended` at once.

    Every contention is logged on the ``distlock.integrations.tasks`` logger and sent as
    :data:`task_lock_busy` (sender: the Task). ``auto_renew`` renews the lease for long
    tasks (a helper thread; for an ``async def`` function, an asyncio task). Raises
    TypeError/ValueError at decoration for a bad template, option or placement (above
    ``@task``, an async generator, a ``lease`` that is not keyword-only, a parameter
    named ``distlock_retries``).
    """
    wait, policy = check_options(
        name, ttl=ttl, timeout=timeout, on_contention=on_contention, countdown=countdown,
        max_retries=max_retries, jitter=jitter,
    )
    permits = None if limit is None else check_permits(limit, "limit")

    def decorate(func: Callable[..., R]) -> Callable[..., Any]:
        _check_function(func)
        function = TaskFunction(func, name, reserved=(RETRIES_KWARG,))
        options: dict[str, Any] = {
            "using": using, "auto_renew": auto_renew, "on_lost": on_lost, "permits": permits,
        }

        def start(args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Run:
            function.refuse_lease(kwargs)
            seconds = check_ttl(ttl)
            return _Run(function, args, kwargs, wrapper, seconds, policy.limit(seconds, wait))

        if iscoroutinefunction(func):
            @functools.wraps(func)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                run = start(args, kwargs)
                ran, value = await arun_locked(
                    lambda lease: function.call(args, run.kwargs, lease), run.name,
                    ttl=run.ttl, timeout=run.limit, holder=run.holder(), **options,
                )
                if ran:
                    return value
                # The policy may send signals and enqueue (database writes): sync code.
                await sync_to_async(run.contended)(policy)
                return None
        else:
            @functools.wraps(func)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                run = start(args, kwargs)
                ran, value = run_locked(
                    lambda lease: function.call(args, run.kwargs, lease), run.name,
                    ttl=run.ttl, timeout=run.limit, holder=run.holder(), **options,
                )
                if ran:
                    return value
                run.contended(policy)
                return None

        function.present(wrapper)
        return wrapper

    return decorate


class _Run:
    """One execution of a locked task: its context, TaskResult, retry count and lock name."""

    def __init__(self, function: TaskFunction, args: tuple[Any, ...], kwargs: dict[str, Any],
                 wrapper: Callable[..., Any], ttl: float, limit: float) -> None:
        self.kwargs = dict(kwargs)
        self.retries = _retries(self.kwargs.pop(RETRIES_KWARG, 0))
        context = args[0] if args and isinstance(args[0], TaskContext) else None
        # Arguments as enqueued: without the context, which the worker adds.
        self.args = args if context is None else args[1:]
        self.result = _running(wrapper) if context is None else context.task_result
        self.name = function.lock_name(args, self.kwargs, skip=0 if context is None else 1)
        self.ttl, self.limit = ttl, limit

    def holder(self) -> str:
        """Who holds the lock, for people reading the lock table."""
        if self.result is None:
            return "task=(called directly)"
        holder = f"task={self.result.task.module_path}[{self.result.id}]"
        if len(self.result.worker_ids) > 1:
            holder += f" attempt={len(self.result.worker_ids)}"
        if self.retries:
            holder += f" retry={self.retries}"
        return holder

    def contended(self, policy: ContentionPolicy) -> None:
        """Apply ``policy`` to this run, which found its lock held: return (the body does
        not run, or runs in a requeued copy) or raise."""
        task = None if self.result is None else self.result.task
        result_id = None if self.result is None else str(self.result.id)
        requeue = None if task is None else _Requeue(task, self.args, self.kwargs, self.retries)
        try:
            policy.contended(Contention(
                task, self.name, self.limit, result_id, self.retries, retry=requeue, log=logger,
            ))
        except _Requeued as queued:
            logger.info("task %s: requeued as task %s", result_id, queued.result_id)


def _check_function(func: object) -> None:
    """Refuse what @task could not run locked: a Task, an async generator, a non-function."""
    if hasattr(func, "enqueue") and hasattr(func, "func"):
        raise TypeError(
            "@locked_task must be placed under @task (the task decorator goes on top), "
            "so that the worker runs the locked function"
        )
    if not inspect.isfunction(func):
        raise TypeError(
            "@locked_task decorates a module-level function (Django Tasks run only "
            f"those), not {type(func).__name__}"
        )
    if inspect.isasyncgenfunction(func):
        raise TypeError(
            f"@locked_task cannot guard {func.__qualname__}(), an async generator function: "
            "a task returns a value, it does not yield"
        )


def _running(wrapper: Callable[..., Any]) -> Any:
    """The TaskResult being run in this thread, if it is a run of ``wrapper``'s task.

    None when the function is called directly (``task.call()``, a plain call) or under a
    backend that does not announce its runs: such a run cannot be requeued.
    """
    result = _started.get()
    if result is None or getattr(result.task, "func", None) is not wrapper:
        return None
    return result


def _retries(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{RETRIES_KWARG} must be a non-negative int, not {value!r}")
    return value
