"""Contention policies: what a locked task does when its lock is held by someone else.

A small object per behaviour, carrying the options that behaviour needs (checked when it
is made) and deciding by its own :meth:`ContentionPolicy.contended` — the shape of
django-pglock's ``Skip``/``Raise``/``Return``. ``locked_task`` keeps the strings
``"retry"``, ``"skip"``, ``"wait"`` and ``"raise"`` as aliases (:func:`resolve`).

No task runner is imported here: a policy decides from the :class:`Contention` it is
handed (the runner's task object, and how to queue the run again), so the same policies
serve Celery (:mod:`distlock.celery`) and Django's Tasks framework (:mod:`distlock.tasks`);
import them from either.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from django.dispatch import Signal

from distlock.exceptions import LockTimeout
from distlock.validation import Seconds, check_seconds, check_timeout

__all__ = [
    "Contention", "ContentionPolicy", "LockContended", "Raise", "Retry", "Skip", "Wait",
    "resolve", "task_lock_busy",
]

logger = logging.getLogger("distlock.integrations.celery")

#: ``on_contention``'s strings (:func:`resolve`).
Alias = Literal["skip", "retry", "wait", "raise"]
ALIASES: tuple[str, ...] = get_args(Alias)

#: Sent in the worker whenever a locked task found its lock held and did not run its
#: body this time: sender=the task; name (lock name), policy (its alias: "skip",
#: "retry", "wait" or "raise"), task_id, retries (the task's retry count so far),
#: countdown (seconds until the retry, or None).
task_lock_busy = Signal()


class LockContended(LockTimeout):
    """A locked task's lock was held by someone else and the policy gave up.

    Raised by :class:`Raise`, and by :class:`Retry` once the retries are used up.
    A :class:`~distlock.LockTimeout`, so code that handles lock timeouts handles it too.
    """

    def __init__(self, name: str, timeout: float | None, task_id: str | None) -> None:
        super().__init__(name, timeout)
        self.task_id = task_id
        self.args = (f"task {task_id}: lock {name!r} is held by someone else",)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.timeout, self.task_id))


@dataclass(frozen=True)
class Contention:
    """One run that found its lock held: what a policy decides about."""

    task: Any  # the running task (None if there is none, e.g. called outside a worker)
    name: str  # the lock name
    limit: float  # how long the run tried for the lock, in seconds
    task_id: str | None
    retries: int  # the task's retry count so far
    # Queues the run again: retry(exc=..., countdown=seconds[, max_retries=n]) returns (or
    # raises) the exception that ends this run, as Celery's Task.retry does. None: the
    # run cannot be queued again (it is not running as a task).
    retry: Callable[..., BaseException] | None = None
    log: logging.Logger = logger  # where the policy says what it decided


class ContentionPolicy:
    """Base of the policies; :meth:`contended` is where each one decides."""

    alias: ClassVar[str]

    def limit(self, ttl: float, timeout: float | None) -> float:
        """Seconds to try for the lock before deciding: ``timeout``, or a single try."""
        return 0.0 if timeout is None else timeout

    def contended(self, busy: Contention) -> None:
        """Return None to skip the task body, or raise (which may be ``task.retry()``)."""
        raise NotImplementedError

    def _announce(self, busy: Contention, outcome: str, countdown: float | None = None) -> None:
        if countdown is None:
            busy.log.warning("task %s: lock %r is busy; %s", busy.task_id, busy.name, outcome)
        else:
            busy.log.info("task %s: lock %r is busy; %s", busy.task_id, busy.name, outcome)
        task_lock_busy.send(
            sender=busy.task, name=busy.name, policy=self.alias, task_id=busy.task_id,
            retries=busy.retries, countdown=countdown,
        )

    def __repr__(self) -> str:
        options = ", ".join(f"{key}={value!r}" for key, value in vars(self).items())
        return f"{type(self).__name__}({options})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), *vars(self).values()))


class Skip(ContentionPolicy):
    """Do not run the body this time; the task returns None."""

    alias = "skip"

    def contended(self, busy: Contention) -> None:
        self._announce(busy, "skipped, the task did not run")


class Raise(ContentionPolicy):
    """Fail the task at once with :class:`LockContended`."""

    alias = "raise"

    def contended(self, busy: Contention) -> None:
        self._announce(busy, "raising")
        raise LockContended(busy.name, busy.limit, busy.task_id)


class Wait(ContentionPolicy):
    """Wait for the lock up to ``timeout`` seconds (default: the TTL), then LockTimeout.

    A task cannot wait forever: it holds a worker's pool slot while it waits.
    Raises TypeError/ValueError for a timeout that is not a non-negative number of
    seconds (or timedelta).
    """

    alias = "wait"

    def __init__(self, timeout: Seconds | None = None) -> None:
        self.timeout = check_timeout(timeout)

    def limit(self, ttl: float, timeout: float | None) -> float:
        if self.timeout is not None:
            return self.timeout
        return ttl if timeout is None else timeout

    def contended(self, busy: Contention) -> None:
        self._announce(busy, f"gave up after waiting {busy.limit} s")
        raise LockTimeout(busy.name, busy.limit)


class Retry(ContentionPolicy):
    """Retry the task in ``countdown`` seconds, plus up to ``jitter`` seconds at random.

    ``jitter=True`` spreads the retries over another ``countdown`` (so contenders do not
    come back together), ``False`` not at all, a number over that many seconds.
    ``max_retries`` (default: the task's own; a Django Tasks task has none, so 3, as
    Celery's default) bounds the retries; then the task fails with :class:`LockContended`.
    Raises TypeError/ValueError for a negative or non-numeric countdown or jitter, or a
    max_retries that is not a non-negative int or None.
    """

    alias = "retry"

    def __init__(
        self, countdown: Seconds = 1.0, *, max_retries: int | None = None,
        jitter: bool | Seconds = True,
    ) -> None:
        self.countdown = check_seconds(countdown, "countdown")
        if self.countdown < 0:
            raise ValueError(f"countdown must not be negative, not {self.countdown}")
        if isinstance(jitter, bool):
            self.jitter = self.countdown if jitter else 0.0
        else:
            self.jitter = check_seconds(jitter, "jitter")
            if self.jitter < 0:
                raise ValueError(f"jitter must not be negative, not {self.jitter}")
        if max_retries is not None and (
            isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0
        ):
            raise ValueError(
                f"max_retries must be a non-negative int or None, not {max_retries!r}"
            )
        self.max_retries = max_retries

    def contended(self, busy: Contention) -> None:
        if busy.retry is None:  # nothing to retry: not running as a task
            self._announce(busy, "raising")
            raise LockContended(busy.name, busy.limit, busy.task_id)
        delay = self.countdown + random.uniform(0, self.jitter)
        self._announce(busy, f"retry {busy.retries + 1} in {delay:.2f} s", countdown=delay)
        options: dict[str, Any] = {"countdown": delay}
        if self.max_retries is not None:
            options["max_retries"] = self.max_retries
        raise busy.retry(exc=LockContended(busy.name, busy.limit, busy.task_id), **options)


def resolve(
    on_contention: ContentionPolicy | str, *, timeout: float | None, countdown: Seconds,
    max_retries: int | None, jitter: bool | Seconds,
) -> ContentionPolicy:
    """The policy for ``locked_task``'s ``on_contention`` and its older keyword options.

    A string is an alias, completed by ``countdown``/``max_retries``/``jitter`` (checked
    whichever alias it is) and ``timeout``. A policy object carries its own options, so
    those keywords must keep their defaults, and a :class:`Wait` with its own timeout
    takes no second one. Raises TypeError/ValueError otherwise.
    """
    if isinstance(on_contention, ContentionPolicy):
        if (countdown, max_retries, jitter) != (1.0, None, True):
            raise TypeError(
                f"on_contention={on_contention!r} carries its own options: pass countdown, "
                "max_retries and jitter to Retry(...), not to locked_task"
            )
        if isinstance(on_contention, Wait) and None not in (on_contention.timeout, timeout):
            raise TypeError(
                f"on_contention={on_contention!r} has its own timeout: do not pass "
                "locked_task(timeout=...) as well"
            )
        return on_contention
    if not isinstance(on_contention, str):
        raise TypeError(
            "on_contention must be a policy (Skip(), Retry(), Wait(), Raise()) or one of "
            f"{ALIASES}, not {type(on_contention).__name__}"
        )
    retry = Retry(countdown, max_retries=max_retries, jitter=jitter)
    policies: dict[str, ContentionPolicy] = {
        "retry": retry, "skip": Skip(), "wait": Wait(timeout), "raise": Raise(),
    }
    if on_contention not in policies:
        raise ValueError(
            f"on_contention must be one of {ALIASES} or a policy (Skip(), Retry(), Wait(), "
            f"Raise()), not {on_contention!r}"
        )
    return policies[on_contention]
