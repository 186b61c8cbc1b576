"""distlock's exceptions cross process boundaries: Celery pickles a task's exception into
its result, and a parent reads a child's. Each one keeps its fields and its message."""

from __future__ import annotations

import pickle

import pytest

from distlock.exceptions import (
    DistlockError,
    LockLost,
    LockTimeout,
    NestedLock,
    NotReplicated,
    StaleToken,
    TokenExhausted,
    TransactionNotAllowed,
)
from distlock.integrations.policies import LockContended
from distlock.integrations.tasks import CannotRequeue

EXCEPTIONS = [
    (LockTimeout("a", 2.5), ("name", "timeout")),
    (LockTimeout("a", None), ("name", "timeout")),
    (LockLost("a", 7, "its row was taken over"), ("name", "token", "reason")),
    (NestedLock("a", 7, "ab" * 16), ("name", "token", "owner")),
    (NotReplicated("acquire", "canceling wait for synchronous replication"),
     ("operation", "warning")),
    (StaleToken("token 3 is older than 4"), ()),
    (TokenExhausted("a"), ()),
    (TransactionNotAllowed("not in atomic()"), ()),
    (LockContended("a", 0.0, "task-1"), ("name", "timeout", "task_id")),
    (CannotRequeue("a", 0.0, "task-1", "ImmediateBackend"),
     ("name", "timeout", "task_id", "backend")),
]


@pytest.mark.parametrize(("error", "fields"), EXCEPTIONS,
                         ids=[type(error).__name__ for error, _ in EXCEPTIONS])
def test_every_exception_pickles_with_its_fields_and_message(error, fields):
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert isinstance(again, DistlockError)
    assert str(again) == str(error)
    assert again.args == error.args
    for field in fields:
        assert getattr(again, field) == getattr(error, field), field
