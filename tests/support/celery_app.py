"""The Celery app of the Celery tests, run by real ``celery worker`` processes.

The test process imports it to send tasks; the workers it starts import it with
``celery -A tests.support.celery_app worker``. Both meet through the broker of :func:`broker_url`:
the filesystem transport (a folder per test session) or Redis. Each session uses its own
queue, so runs sharing a Redis server do not take each other's tasks.

Tasks report what happened as JSON lines appended to ``events.jsonl`` in the session
folder (tests/support/events.py); times come from the database clock, like the leases'.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

from celery import Celery, Task, current_task, signals  # noqa: E402 - the fixup needs settings
from django.dispatch import receiver  # noqa: E402

from demo_project import kombu_filesystem  # noqa: E402, F401 - filesystem:// writes whole files
from distlock.integrations.celery import (  # noqa: E402
    ContentionPolicy,
    Raise,
    Retry,
    Skip,
    Wait,
    locked_task,
    task_lock_busy,
    unique_task,
)
from distlock.signals import lock_not_acquired  # noqa: E402
from tests.support import events  # noqa: E402

DIR_ENV = "DISTLOCK_TEST_CELERY_DIR"
QUEUE_ENV = "DISTLOCK_TEST_CELERY_QUEUE"
VISIBILITY_ENV = "DISTLOCK_TEST_CELERY_VISIBILITY"

app = Celery("distlock_tests")


def broker_url() -> str:
    """The broker of this run.

    DISTLOCK_TEST_BROKER picks it: ``filesystem`` or a ``redis://`` URL (``redis`` alone
    means DISTLOCK_TEST_REDIS or redis://127.0.0.1:6379/0). Unset, the PostgreSQL run uses
    Redis when DISTLOCK_TEST_REDIS is configured (as CI does), every other run the
    filesystem broker: Redis + PostgreSQL and filesystem + SQLite, the two set-ups the
    Celery tests must cover, without running the Redis variant three times.
    """
    redis = os.environ.get("DISTLOCK_TEST_REDIS") or "redis://127.0.0.1:6379/0"
    broker = os.environ.get("DISTLOCK_TEST_BROKER")
    if not broker:
        backend = os.environ.get("DISTLOCK_TEST_BACKEND", "sqlite")
        configured = os.environ.get("DISTLOCK_TEST_REDIS")
        broker = "redis" if backend == "postgresql" and configured else "filesystem"
    if broker == "filesystem":
        return "filesystem://"
    if broker == "redis":
        return redis
    if broker.startswith(("redis://", "rediss://")):
        return broker
    raise RuntimeError(f"DISTLOCK_TEST_BROKER={broker!r}: use filesystem, redis or a redis:// URL")


def configure(base: Path, queue: str, visibility: float | None = None) -> None:
    """Point the app at the session's broker folder/queue, dropping the connections made
    under the previous configuration (:func:`_forget_connections`)."""
    _forget_connections()
    url = broker_url()
    options: dict[str, Any]
    if url == "filesystem://":
        for sub in ("queue", "control", "tmp"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        options = {
            "data_folder_in": str(base / "queue"),
            "data_folder_out": str(base / "queue"),
            "control_folder": str(base / "control"),
            "polling_interval": 0.1,
        }
    else:
        options = {"visibility_timeout": visibility or 300}
        if visibility:
            # Look for expired unacknowledged messages every second, not every 100 s.
            options.update(unacked_restore_interval=1, unacked_restore_throttle=1)
    app.conf.update(
        broker_url=url,
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
        task_default_queue=queue,
        task_ignore_result=True,
        result_backend=None,
        worker_prefetch_multiplier=1,
        # How long the pool waits for a killed child's result before requeueing its task
        # (reject_on_worker_lost); the default 10 s only slows the SIGKILL test down.
        worker_lost_wait=1.0,
        worker_hijack_root_logger=False,
    )


def _forget_connections() -> None:
    """Drop the app's broker connection and producer pools, and kombu's global ones.

    They are made at the first send and kept: kombu keys its global pools by the broker
    URL, which is the same for every test module (``filesystem://``, one Redis URL), not by
    the transport options that name the module's folder or queue. A second module that
    configured the app (tests/test_unique_tasks.py, then tests/test_celery.py) sent to the
    first module's folder through the kept pool, and its worker saw nothing. Closing only
    the app's pool is not enough either: kombu's global group then hands the closed pool
    back ("Acquire on closed pool", found by a CI run of 2026-12-05)."""
    import kombu.pools

    pool = app._pool
    if pool is not None:
        pool.force_close_all()
    app._pool = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None
    kombu.pools.reset()


if os.environ.get(DIR_ENV):  # in a worker started by the tests
    configure(
        Path(os.environ[DIR_ENV]), os.environ[QUEUE_ENV],
        float(os.environ[VISIBILITY_ENV]) if os.environ.get(VISIBILITY_ENV) else None,
    )


def base_dir() -> Path:
    return Path(os.environ[DIR_ENV])


def record(kind: str, **data: Any) -> None:
    """Append one event line to the session folder's events.jsonl."""
    events.record(base_dir(), kind, **data)


def wait_for_file(name: str, timeout: float = 60.0) -> bool:
    """Block until the test creates ``name`` in the session folder (a go signal)."""
    return events.wait_for_file(base_dir() / name, timeout)


def _lease_event(kind: str, task: Any, key: str, lease: Any) -> None:
    from distlock import current_lease
    from tests.support.helpers import us

    record(
        kind, task_id=task.request.id, key=key, retries=task.request.retries,
        token=lease.token, owner=lease.owner, acquired_us=us(lease.acquired_at),
        expires_us=us(lease.expires_at), current=current_lease() is lease,
        redelivered=bool((task.request.delivery_info or {}).get("redelivered")),
    )


def _make(policy: str | ContentionPolicy, suffix: str = "", **options: Any) -> Any:
    alias = policy if isinstance(policy, str) else policy.alias

    @app.task(bind=True, name=f"tests.hold_{alias}{suffix}")
    @locked_task("test:{key}", ttl=options.pop("ttl", 30), on_contention=policy, **options)
    def hold(self: Any, key: str, seconds: float = 0.0, *, lease: Any) -> int:
        """Hold the lock ``seconds`` (or until the test's go file ``key`` appears)."""
        _lease_event("start", self, key, lease)
        if seconds < 0:
            wait_for_file(f"go-{key}")
        else:
            time.sleep(seconds)
        _lease_event("end", self, key, lease)
        return lease.token

    return hold


hold_wait = _make("wait", timeout=30)
hold_wait_short = _make("wait", "_short", timeout=0.5)
hold_skip = _make("skip")
hold_retry = _make("retry", countdown=0.2, jitter=0.1, max_retries=50)
hold_retry_once = _make("retry", "_once", countdown=0.1, jitter=False, max_retries=1)
hold_raise = _make("raise")
hold_renewed = _make("raise", "_renewed", ttl=1.5, auto_renew=True)
# The same behaviours given as policy objects rather than aliases.
obj_wait = _make(Wait(30), "_object")
obj_wait_short = _make(Wait(timeout=0.5), "_object_short")
obj_skip = _make(Skip(), "_object")
obj_retry = _make(Retry(0.2, jitter=0.1, max_retries=50), "_object")
obj_retry_once = _make(Retry(countdown=0.1, jitter=False, max_retries=1), "_object_once")
obj_raise = _make(Raise(), "_object")


@app.task(bind=True, name="tests.retry_self")
@locked_task("test:{key}", ttl=30, on_contention="skip")
def retry_self(self: Any, key: str, *, lease: Any) -> int:
    """Ask for a retry on the first run: the retried run must get a new, higher token.

    The retry is queued (countdown 0) half a second before this run leaves the body and
    releases, so the other pool child starts it while the lock is still held by this
    run; it must wait for that release rather than skip.
    """
    _lease_event("start", self, key, lease)
    if self.request.retries == 0:
        retry = self.retry(countdown=0, max_retries=3, throw=False)
        time.sleep(0.5)
        raise retry
    _lease_event("end", self, key, lease)
    return lease.token


@app.task(bind=True, name="tests.late_skip", acks_late=True)
@locked_task("test:{key}", ttl=30, on_contention="skip")
def late_skip(self: Any, key: str, *, lease: Any) -> int:
    """acks_late and skip: a redelivered copy meeting the running first copy skips."""
    _lease_event("start", self, key, lease)
    wait_for_file(f"go-{key}")
    _lease_event("end", self, key, lease)
    return lease.token


@app.task(bind=True, name="tests.killable", acks_late=True, reject_on_worker_lost=True)
@locked_task("test:{key}", ttl=2, on_contention="wait", timeout=30)
def killable(self: Any, key: str, *, lease: Any) -> int:
    """The test SIGKILLs the child running the first copy; the requeued copy runs once."""
    _lease_event("start", self, key, lease)
    wait_for_file(f"go-{key}")
    _lease_event("end", self, key, lease)
    return lease.token


@app.task(bind=True, name="tests.fail")
@locked_task("test:{key}", ttl=30, on_contention="raise")
def fail(self: Any, key: str, *, lease: Any) -> None:
    """The body raises: the lock must be released then, not left to run out its ttl."""
    _lease_event("start", self, key, lease)
    raise RuntimeError(f"the body failed holding token {lease.token}")


@app.task(name="tests.unbound")
@locked_task(lambda key: f"test:{key}", ttl=30, on_contention="raise")
def unbound(key: str) -> None:
    """Not bound, name from a callable: the lease comes from current_lease()."""
    from distlock import current_lease

    lease = current_lease()
    record("unbound", key=key, token=lease.token if lease else None)


@app.task(bind=True, name="tests.inner_times_out")
@locked_task("test:{key}", ttl=30, on_contention="skip")
def inner_times_out(self: Any, key: str, *, lease: Any) -> None:
    """The body takes a second lock, ``test:<key>:inner`` (the test holds it), with a
    timeout: its LockTimeout is the body's failure, not contention for ``test:<key>``."""
    from distlock import lock

    _lease_event("start", self, key, lease)
    with lock(f"test:{key}:inner", ttl=30, timeout=0.2):
        _lease_event("end", self, key, lease)


# Lock names whose busy tries wait for the test (_gate_busy_try).
GATED = "gated:"


@app.task(bind=True, name="tests.retry_gated")
@locked_task(GATED + "{key}", ttl=30, on_contention="skip")
def retry_gated(self: Any, key: str, *, lease: Any) -> int:
    """Ask for a retry on the first run, then hold the lock until the test's go file: the
    retried run meets it, and its busy try waits at the gate (_gate_busy_try) while the
    test lets this run release."""
    _lease_event("start", self, key, lease)
    if self.request.retries == 0:
        retry = self.retry(countdown=0, max_retries=3, throw=False)
        wait_for_file(f"go-{key}")
        raise retry
    _lease_event("end", self, key, lease)
    return lease.token


@receiver(lock_not_acquired)
def _gate_busy_try(sender: Any, name: str, **kwargs: Any) -> None:
    """A try that found a ``gated:`` lock held reports it and waits for the test's file
    ``gate-<key>``: the test decides what happens between that try and the run's next
    step (a gate in the worker's own code path, not a stand-in for it)."""
    if not name.startswith(GATED):
        return
    key = name.removeprefix(GATED)
    task = current_task
    record("busy_try", key=key, name=name, task_id=task.request.id if task else None,
           retries=task.request.retries if task else None)
    wait_for_file(f"gate-{key}")


@receiver(task_lock_busy)
def _busy(sender: Any, name: str, policy: str, task_id: str | None, retries: int,
          countdown: float | None, **kwargs: Any) -> None:
    if not isinstance(sender, Task):
        return  # not a Celery task: e.g. a Django Tasks task (tests/support/tasks.py)
    request = getattr(sender, "request", None)
    record(
        "busy", task_id=task_id, name=name, policy=policy, retries=retries,
        countdown=countdown,
        redelivered=bool((getattr(request, "delivery_info", None) or {}).get("redelivered")),
    )


@app.task(name="tests.unique_body")
@unique_task
def unique_body(key: str, n: int, hold: bool = False) -> int:
    """tests/test_unique_tasks.py: record the run (``n``: which enqueue sent it); with
    ``hold``, wait for the test's go file ``go-<key>`` (records nothing called in the test
    process, which has no session folder)."""
    if not os.environ.get(DIR_ENV):
        return n
    record("unique_start", key=key, n=n)
    if hold:
        wait_for_file(f"go-{key}")
    record("unique_end", key=key, n=n)
    return n


@signals.task_postrun.connect
def _postrun(sender: Any = None, task_id: str | None = None, args: Any = None,
             **kwargs: Any) -> None:
    """Every finished run of unique_body, skipped or not (the debounce test counts them)."""
    if getattr(sender, "name", None) == "tests.unique_body":
        record("postrun", task_id=task_id, key=(args or [None])[0])


@signals.task_failure.connect
def _failed(sender: Any = None, task_id: str | None = None, exception: Any = None,
            **kwargs: Any) -> None:
    record("failed", task_id=task_id, error=type(exception).__name__, message=str(exception))


@signals.worker_ready.connect
def _ready(sender: Any = None, **kwargs: Any) -> None:
    (base_dir() / f"ready-{sender.hostname}").write_text(str(os.getpid()))
