"""A lock asked for where it is already held: NestedLock at once (issue 27, item 8).

``with lock("x"): with lock("x"):`` in one thread (or ``alock`` in one asyncio task) used
to wait for its own outer lease until it expired, then take the lock over from it (token
+1; the outer block ended "no longer held"). Now the inner acquire raises NestedLock
before any SQL, naming the outer lease, and the outer lease stays held with its token.
What counts as "here" (distlock.core.locks.refuse_nested): the thread, or the asyncio task,
that entered the block, with what it runs on its behalf (sync_to_async, async_to_sync);
another thread, or a task created inside the block, is another holder and waits.
"""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import import_module
from typing import Any

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from celery import Celery
from django.db import connections, transaction

from distlock import (
    DistlockError,
    Lease,
    LockTimeout,
    NestedLock,
    aacquire,
    acquire,
    alock,
    alocked,
    lock,
    locked,
)
from distlock.integrations.celery import locked_task as celery_locked_task
from distlock.integrations.tasks import FRAMEWORK, locked_task
from distlock.models import Lock
from tests.support.helpers import (
    run_async,
    run_with_deadline,
    sync_layer_statements,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("lock_db")

# The outer leases' ttl: a nested acquire that waited for its own lease would take this
# long; NestedLock must come well within it.
TTL = 30
# The inner acquires' timeout: without the check they would fail with LockTimeout after
# this (not hang for the ttl), so a missing check fails the test quickly.
INNER_TIMEOUT = 3
AT_ONCE = 1.0


def row(name: str) -> Lock:
    return Lock.objects.get(name=name)


@contextmanager
def statements(alias: str = "default") -> Iterator[list[str]]:
    """The SQL this thread's connection to ``alias`` sends inside the block."""
    sent: list[str] = []

    def watch(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append(sql)
        return execute(sql, params, many, context)

    with connections[alias].execute_wrapper(watch):
        yield sent


def assert_nested(error: NestedLock, outer: Lease) -> None:
    assert (error.name, error.token, error.owner) == (outer.name, outer.token, outer.owner)
    assert repr(outer.name) in str(error) and f"token {outer.token}" in str(error)
    assert isinstance(error, DistlockError) and not isinstance(error, LockTimeout)


def assert_still_held(outer: Lease) -> None:
    stored = row(outer.name)
    assert (stored.owner, stored.token) == (outer.owner, outer.token)
    assert not stored.is_free and outer.remaining() > TTL / 2


@locked("nest:{key}", ttl=TTL, timeout=INNER_TIMEOUT)
def locked_call(key: str) -> str:
    return key


INNER: dict[str, Callable[[str], object]] = {
    "lock": lambda name: lock(name, ttl=TTL, timeout=INNER_TIMEOUT).__enter__(),
    "acquire": lambda name: acquire(name, ttl=TTL, timeout=INNER_TIMEOUT),
    "acquire-nonblocking": lambda name: acquire(name, ttl=TTL, blocking=False),
    "locked": lambda name: locked_call(name.removeprefix("nest:")),
    "other-alias": lambda name: acquire(name, ttl=TTL, timeout=INNER_TIMEOUT, using="locks"),
}


# -- sync: one thread ---------------------------------------------------------------------


@pytest.mark.parametrize("form", sorted(INNER))
def test_a_nested_lock_of_the_same_name_raises_at_once_and_the_outer_lease_stays(form):
    name = "nest:sync"
    with lock(name, ttl=TTL) as outer:
        with statements() as sent, statements("locks") as sent_locks:
            began = time.monotonic()
            with pytest.raises(NestedLock) as caught:
                INNER[form](name)
            took = time.monotonic() - began
        assert took < AT_ONCE, f"NestedLock after {took:.2f} s"
        assert sent == [] and sent_locks == [], "refused before any SQL"
        assert_nested(caught.value, outer)
        assert_still_held(outer)
        outer.renew()  # still the holder, by the database
    stored = row(name)
    assert stored.is_free and stored.token == outer.token, "no second grant"
    assert outer.released_at is not None, "the block released a lease it still held"


@pytest.mark.django_db(transaction=True, databases=["default", "locks"])
@pytest.mark.parametrize("alias", ["default", "locks"])
def test_a_nested_lock_inside_the_callers_own_transaction_still_raises_before_any_sql(alias):
    """The caller turned autocommit off (its own transaction, on the lock's database or
    through the other alias of it): the nested lock is refused at once, before a statement
    could join that transaction, and the outer lease is untouched."""
    name = "nest:autocommit"
    with lock(name, ttl=TTL) as outer:
        transaction.set_autocommit(False, using=alias)
        try:
            with (
                statements() as sent,
                statements("locks") as sent_locks,
                pytest.raises(NestedLock) as caught,
            ):
                lock(name, ttl=TTL, timeout=INNER_TIMEOUT, using=alias).__enter__()
            assert sent == [] and sent_locks == [], "refused before any SQL"
        finally:
            transaction.rollback(using=alias)
            transaction.set_autocommit(True, using=alias)
        assert_nested(caught.value, outer)
        assert_still_held(outer)
    assert row(name).is_free and row(name).token == outer.token


def test_nesting_other_names_and_a_lock_released_inside_its_block_are_no_nesting():
    with lock("nest:a", ttl=TTL) as a:
        with lock("nest:b", ttl=TTL) as b:
            assert b.token >= 1
        a.release()
        with lock("nest:a", ttl=TTL, timeout=INNER_TIMEOUT) as again:
            assert again.token == a.token + 1
    assert row("nest:a").is_free and row("nest:b").is_free


def test_another_thread_is_another_holder_and_finds_the_lock_busy():
    name = "nest:thread"
    with lock(name, ttl=TTL) as outer:
        assert run_with_deadline(lambda: acquire(name, ttl=TTL, blocking=False)) is None
        assert_still_held(outer)


def test_nested_lock_pickles_with_its_lease():
    error = NestedLock("nest:x", 7, "ab" * 16)
    again = pickle.loads(pickle.dumps(error))
    assert (again.name, again.token, again.owner, str(again)) == (
        error.name, error.token, error.owner, str(error))


# -- async: one task ----------------------------------------------------------------------


@alocked("nest:{key}", ttl=TTL, timeout=INNER_TIMEOUT)
async def alocked_call(key: str) -> str:
    return key


async def _alock_form(name: str) -> None:
    async with alock(name, ttl=TTL, timeout=INNER_TIMEOUT):
        pass


AINNER: dict[str, Callable[[str], Any]] = {
    "alock": _alock_form,
    "aacquire": lambda name: aacquire(name, ttl=TTL, timeout=INNER_TIMEOUT),
    "aacquire-nonblocking": lambda name: aacquire(name, ttl=TTL, blocking=False),
    "alocked": lambda name: alocked_call(name.removeprefix("nest:")),
    # Sync code the task runs through sync_to_async is the task's own.
    "sync_to_async": sync_to_async(
        lambda name: acquire(name, ttl=TTL, timeout=INNER_TIMEOUT)),
}


@pytest.mark.parametrize("form", sorted(AINNER))
def test_a_nested_alock_in_the_same_task_raises_at_once_and_the_outer_lease_stays(form):
    name = "nest:async"

    async def body():
        async with sync_layer_statements() as sent, alock(name, ttl=TTL) as outer:
            mark = len(sent)
            began = time.monotonic()
            with pytest.raises(NestedLock) as caught:
                await AINNER[form](name)
            took = time.monotonic() - began
            assert len(sent) == mark, "refused before any SQL"
            await sync_to_async(assert_still_held)(outer)
            await outer.arenew()
        return outer, caught.value, took

    outer, error, took = run_async(body)
    assert took < AT_ONCE, f"NestedLock after {took:.2f} s"
    assert_nested(error, outer)
    stored = row(name)
    assert stored.is_free and stored.token == outer.token
    assert outer.released_at is not None


def test_a_task_created_inside_the_block_is_another_holder_and_waits_for_it():
    """It inherits a copy of the block's context, but it is not the block: a busy lock
    (timeout=0), or a wait that the block's end ends with the next token."""
    name = "nest:child"

    async def body():
        async def child(timeout: float) -> int:
            async with alock(name, ttl=TTL, timeout=timeout) as lease:
                return lease.token

        async with sync_layer_statements() as sent, alock(name, ttl=TTL) as outer:
            with pytest.raises(LockTimeout):
                await asyncio.create_task(child(0))
            mark = len(sent)
            waiting = asyncio.create_task(child(INNER_TIMEOUT * 3))
            # Its first try goes out while the block holds the lock: refused, it waits.
            await wait_for(lambda: len(sent) > mark or waiting.done(), what="a try sent")
            assert not waiting.done()
        return outer, await waiting

    outer, token = run_async(body)
    assert token == outer.token + 1
    assert row(name).is_free


def test_a_coroutine_run_by_async_to_sync_inside_a_sync_block_is_nested():
    name = "nest:async-to-sync"
    with lock(name, ttl=TTL) as outer:
        began = time.monotonic()
        with pytest.raises(NestedLock) as caught:
            async_to_sync(_alock_form)(name)
        assert time.monotonic() - began < AT_ONCE
        assert_nested(caught.value, outer)
        assert_still_held(outer)


# -- the task decorators: a run inside a lock block of its own lock name --------------------

django_task = import_module(FRAMEWORK).task


@django_task()
@locked_task("nest:task:{key}", ttl=TTL, on_contention="wait", timeout=INNER_TIMEOUT)
def django_locked(key: str, *, lease: Any) -> int:
    return int(lease.token)


@django_task()
@locked_task("nest:task:{key}", ttl=TTL, on_contention="wait", timeout=INNER_TIMEOUT)
async def django_alocked(key: str, *, lease: Any) -> int:
    return int(lease.token)


celery_app = Celery("distlock_nesting", set_as_current=False)


@celery_app.task(bind=True)
@celery_locked_task("nest:task:{key}", ttl=TTL, on_contention="wait", timeout=INNER_TIMEOUT)
def celery_locked(self: Any, key: str, *, lease: Any) -> int:
    return int(lease.token)


def test_a_locked_task_run_inside_a_block_of_its_lock_name_raises_nested():
    name = "nest:task:1"
    with lock(name, ttl=TTL) as outer:
        for run in (
            lambda: django_locked.func("1"),
            lambda: celery_locked("1"),
        ):
            began = time.monotonic()
            with pytest.raises(NestedLock) as caught:
                run()
            assert time.monotonic() - began < AT_ONCE
            assert_nested(caught.value, outer)
        assert_still_held(outer)
    # Outside the block the same runs get the lock, one token each.
    assert django_locked.func("1") == outer.token + 1
    assert celery_locked("1") == outer.token + 2


def test_a_locked_async_task_run_inside_an_alock_of_its_lock_name_raises_nested():
    name = "nest:task:2"

    async def body():
        async with alock(name, ttl=TTL) as outer:
            began = time.monotonic()
            with pytest.raises(NestedLock) as caught:
                await django_alocked.func("2")
            took = time.monotonic() - began
            await sync_to_async(assert_still_held)(outer)
        return outer, caught.value, took

    outer, error, took = run_async(body)
    assert took < AT_ONCE
    assert_nested(error, outer)
    assert row(name).is_free and row(name).token == outer.token

