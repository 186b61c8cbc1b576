"""The transaction runner: each lock operation, one short transaction on the lock's database.

The SQL lives in :mod:`distlock.backends`. Callers run an operation by its name, a method
of :class:`~distlock.backends.base.Backend`::

    held, released_us = db.run(alias, "release", name, owner, token)

run() picks the backend of the alias's connection (``backend_for``), refuses to run
inside the caller's transaction, and calls ``backend.release(cursor, name, owner, token)``
in a durable transaction of its own — or, for an operation the backend lists in
``one_statement``, as one statement in autocommit mode — retrying the whole transaction
when the database aborted it (serialization failures, deadlocks).
"""

from __future__ import annotations

from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from distlock.backends import backend_for, supported
from distlock.backends.base import Backend
from distlock.backends.pg_syncrep import unreplicated, watching
from distlock.exceptions import DistlockError, NotReplicated, TransactionNotAllowed

# Serialization failures and deadlocks abort the whole transaction: safe to run it again.
RETRIES = 5
# NotReplicated's words for an operation.
_DOING = {"acquire_existing": "grant", "acquire_new": "grant", "renew": "renewal"}


def _not_replicated(operation: str, args: tuple[Any, ...], warning: str) -> NotReplicated:
    doing = _DOING.get(operation, operation)
    if args and isinstance(args[0], str):
        doing = f"{doing} of lock {args[0]!r}"
    return NotReplicated(doing, warning)


def in_transaction(connection: BaseDatabaseWrapper) -> bool:
    """True if statements on ``connection`` would join a transaction the caller opened.

    Inside ``atomic()``, and also with autocommit turned off by hand
    (``transaction.set_autocommit(False)``): Django's ``atomic(durable=True)`` then only
    pretends to start a transaction, and what it "commits" stays in the caller's.
    """
    return connection.in_atomic_block or (
        connection.connection is not None and not connection.autocommit
    )


def same_settings(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """True if two DATABASES entries name the same physical database.

    Compared by ENGINE, NAME, HOST and PORT: two spellings of one server (a socket and
    127.0.0.1) count as different, which only skips the ownership check, never wrongly
    runs it against a database that has no lock table.
    """
    keys = ("ENGINE", "NAME", "HOST", "PORT")
    return all(str(a.get(key) or "") == str(b.get(key) or "") for key in keys)


def same_database(alias: str, other: str) -> bool:
    """True if two aliases reach the same physical database (so one transaction sees both)."""
    if alias == other:
        return True
    return same_settings(connections[alias].settings_dict, connections[other].settings_dict)


def _namesakes(connection: BaseDatabaseWrapper) -> tuple[str, ...]:
    """The other aliases whose DATABASES entry has the same NAME as ``connection``'s: the
    only ones whose transaction can hold a single-writer database's write lock.

    Found once per connection object (Django makes new ones when DATABASES changes), so
    that with one alias per database — the usual case — a lock operation does not look
    through every connection of the thread each time.
    """
    found: tuple[str, ...] | None = getattr(connection, "_distlock_namesakes", None)
    if found is None:
        name = connection.settings_dict.get("NAME")
        found = tuple(
            other for other in connections
            if other != connection.alias and connections[other].settings_dict.get("NAME") == name
        )
        connection._distlock_namesakes = found  # type: ignore[attr-defined]
    return found


def refuse_atomic(connection: BaseDatabaseWrapper, backend: Backend | None = None) -> None:
    """Raise TransactionNotAllowed if a lock operation on this connection could not commit
    on its own: inside atomic(), or with autocommit off (set_autocommit(False)).

    On a database with one writer (SQLite) also inside a transaction on another alias of
    the same database: the lock transaction would wait for the caller's own transaction
    forever (until the busy timeout).
    """
    alias = connection.alias
    backend = backend or backend_for(connection)
    if backend.single_writer and not in_transaction(connection):
        # Only the aliases of the same file can hold its write lock: looking through
        # every connection of the thread instead cost ~25 µs per operation.
        for other_alias in _namesakes(connection):
            other = connections[other_alias]
            if in_transaction(other):
                backend.refuse_shared_writer(connection, other)
    # get_autocommit() connects first: a fresh connection is in autocommit mode unless
    # the caller turned it off, and that is what must be known before the first statement.
    if connection.in_atomic_block or not connection.get_autocommit():
        where = (
            "inside transaction.atomic()" if connection.in_atomic_block
            else "with autocommit turned off (transaction.set_autocommit(False))"
        )
        raise TransactionNotAllowed(
            f"distlock was called {where} on database {alias!r}. "
            "A lock grant, renewal or release must commit on its own, before your code goes "
            "on; inside your transaction it would commit or roll back with it (and a "
            "rollback would hand the same fencing token out twice). Call it outside the "
            "transaction, or give distlock its own connection to the same database: "
            f"DATABASES['distlock'] = {{**DATABASES[{alias!r}]}} and "
            "DISTLOCK_DATABASE = 'distlock'."
        )


def _drop_if_broken(connection: BaseDatabaseWrapper) -> None:
    """Close the connection if an earlier error broke it, so the next statement reconnects.

    Outside the request cycle nobody replaces a connection that broke (a database restart,
    a killed backend). Only a connection that saw an error is checked, and only a broken
    one is closed: Django's close_if_unusable_or_obsolete() would also close a healthy
    connection whenever CONN_MAX_AGE has passed — with the default CONN_MAX_AGE = 0 that is
    every time, a new connection per lock operation (several ms each), and it would drop
    the session of a caller who shares the alias in the middle of its request.
    """
    if connection.connection is not None and connection.errors_occurred:
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            connection.close()


def session_started(sender: Any, connection: BaseDatabaseWrapper, **kwargs: Any) -> None:
    """The ``connection_created`` receiver: the vendor's set-up of a new session."""
    backend = supported(connection)
    if backend is not None:
        backend.session_started(connection)


def run(alias: str, operation: str, *args: Any) -> Any:
    """Run ``backend.<operation>(cursor, *args)`` in its own durable transaction.

    Retries the whole transaction on serialization failures and deadlocks, which the
    database resolves by aborting it (REPEATABLE READ on PostgreSQL, gap locks on MariaDB).
    """
    return run_on(connections[alias], None, operation, *args)


def run_on(
    connection: BaseDatabaseWrapper, backend: Backend | None, operation: str, *args: Any
) -> Any:
    """:func:`run` on a connection (and backend) the caller has already looked up.

    The acquire path looks them up once per acquire and passes them here, instead of
    once per step (each ``connections[alias]`` is a thread-local lookup of a few µs).
    """
    if backend is None:
        backend = backend_for(connection)
    refuse_atomic(connection, backend)
    _drop_if_broken(connection)
    method = getattr(backend, operation)
    # An operation that is one statement on this database is its own transaction in
    # autocommit mode: no BEGIN and COMMIT round trips around it. (refuse_atomic has just
    # made sure the connection is in autocommit mode.)
    alone = operation in backend.one_statement
    # PostgreSQL: a commit whose wait for a synchronous standby was cancelled comes back
    # as success with a WARNING, which the session's notice handler marks (pg_syncrep).
    watching(connection)
    attempt = 0
    while True:
        attempt += 1
        try:
            if alone:
                if connection.connection is None:
                    # _drop_if_broken closed it, or a retry follows a lost connection.
                    connection.ensure_connection()
                with backend.statement_cursor(connection) as cursor:
                    result = method(cursor, *args)
            else:
                with (
                    transaction.atomic(using=connection.alias, durable=True),
                    connection.cursor() as cursor,
                ):
                    result = method(cursor, *args)
        except DatabaseError as exc:
            # A terminated backend sends the WARNING, then closes the connection.
            if (warning := unreplicated(connection)) is not None:
                raise _not_replicated(operation, args, warning) from exc
            if attempt >= RETRIES or not backend.retryable(exc):
                raise
            continue
        except DistlockError:
            raise
        except BaseException:
            # From outside the database (KeyboardInterrupt, a Celery soft time limit):
            # the one place that cleans up after it, on both paths (Backend.interrupted).
            backend.interrupted(connection)
            raise
        if (warning := unreplicated(connection)) is not None:
            raise _not_replicated(operation, args, warning)
        return result


def db_now_us(alias: str) -> int:
    """The database server's clock, in epoch microseconds (a plain query, no transaction)."""
    connection = connections[alias]
    with connection.cursor() as cursor:
        return backend_for(connection).now(cursor)
