"""Fenced writes: the protected rows themselves refuse a stale lock holder.

A :class:`FencedModel` row carries ``fence_token``, the highest fencing token written to
it, and declares which lock guards it (``fence_name``, a ``str.format`` template over its
fields, or :meth:`FencedModel.get_fence_name`). Every fenced write runs in one
transaction on the model's database and is decided there, never by Python:

1. *Ownership check* (when the lock table lives in the same database): a locking read of
   the lock row that requires this lease's owner and token and an expiry later than the
   database's real-time clock. It holds a shared row lock (SQLite: the IMMEDIATE write
   lock) until the write commits, so a take-over waits for the commit, and a lease that
   has run out can commit nothing at all.
2. *High-water mark*: one conditional statement, ``UPDATE … SET fence_token = :token
   WHERE … AND fence_token <= :token`` (plus the row's lock name, computed in SQL). No
   row matched means a newer token wrote the row first.

On PostgreSQL, outside the caller's ``atomic()``, ``save(fence=)`` of an existing row and
``fenced_update`` are *one* autocommit statement: the ownership check is folded into the
conditional UPDATE as ``(SELECT distlock_holds(…))`` (the same locking read, FOR SHARE,
in a function of backends/postgresql_functions.py), which PostgreSQL runs once, before
it writes a row, holding the share lock until the statement commits. Same check, same lock,
one round trip and one commit instead of five (see the README, Performance).

A refusal raises :class:`~distlock.exceptions.StaleToken`, writes nothing (the statement
matched no row, or the transaction is rolled back: a savepoint inside the caller's
``atomic()``), marks the lease lost and sends ``stale_write_refused``.

The package, one job per module (only the names below are its public API):

* ``templates``: ``fence_name`` templates, the values they format, their SQL expression;
* ``conditions``: the one builder of the fenced condition (:class:`~.conditions.Fence`);
* ``ownership``: the ownership check and the transaction around every fenced write;
* ``query``: FencedQuerySet and FencedManager; ``models``: FencedModel;
* ``django_hooks``: the one override of a private Django method (``Model._do_update``).
"""

from __future__ import annotations

from distlock.constants import FENCE_FIELD
from distlock.fencing.models import FencedModel
from distlock.fencing.query import FencedManager, FencedQuerySet, is_fenced_manager
from distlock.fencing.templates import (
    nullable_template_fields,
    parse_fence_name,
    template_problems,
)

__all__ = [
    "FENCE_FIELD",
    "FencedManager",
    "FencedModel",
    "FencedQuerySet",
    "is_fenced_manager",
    "nullable_template_fields",
    "parse_fence_name",
    "template_problems",
]
