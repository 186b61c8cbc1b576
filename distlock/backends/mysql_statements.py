"""MariaDB: acquire, renew and release as one plain statement each (no procedure).

Kept apart from mysql.py only for its length. Each statement is its own transaction in
autocommit mode and decides under the lock row's lock, which InnoDB takes before the
statement's expressions run: the ODKU assignments and the UPDATEs' WHERE and SET read the
clock (SYSDATE, real time, not NOW, the statement's start) after any wait for that lock
(tests/test_mysql_procedures.py holds the row from another connection to show it).
MariaDB evaluates ODKU and UPDATE assignments left to right, each seeing the new values
of the ones before it; user variables (``@distlock_…``) carry what the first assignment
decided to the others. Owners compare as bytes (``CAST … AS BINARY``), as the procedures'
VARBINARY parameters do: the owner column's collation may fold case.

- :func:`acquire_sql` (MariaDB 10.5+: ``INSERT … RETURNING``): an ``INSERT … SELECT`` from
  the token floor, read with a share lock held to the commit (see
  :meth:`~distlock.backends.base.Backend.acquire_new`), so a first use starts one above
  it; for an existing row the ODKU grants only a free or expired one and otherwise leaves
  every column as it was. RETURNING answers with the row as it is now and
  ``@distlock_prev`` (the holder whose expired lease was taken over, '' otherwise) and
  ``@distlock_now``. No row comes back when the floor row is missing or at MAX_TOKEN:
  the caller runs the procedure then, which restores the floor or says exhausted. On a
  first use the clock is read before the insert's own wait for the key: that wait ends
  either with the row there (another session created it first: the ODKU runs, with its
  own clock after the lock) or with the key still free, which no lease held.
- :func:`renew_sql`: one UPDATE whose WHERE is the renewal's condition; the new time comes
  back as ``LAST_INSERT_ID``, in the OK packet (mysqlclient's ``lastrowid``). Zero rows
  matched: refused, and a plain read of the row (:data:`REFUSED`) says why: no row, or
  another grant, or else expired (the lease's own row can only have run out).
- :func:`release_sql`: one UPDATE of the current grant (owner and token); ``LAST_INSERT_ID``
  packs the release time and whether the lease was still unexpired as ``2 * now + held``.

Each is built by a function of the clock's SQL (the backend's ``now_sql()``, which
tests/test_boundaries.py pins to a literal), cached. Params: acquire (name, owner, holder,
ttl_us, ttl_us); renew (ttl_us, name, owner, token); release (name, owner, token).
"""

from __future__ import annotations

from functools import lru_cache

from distlock.constants import FLOOR_ID, FLOOR_TABLE, LOCK_TABLE, MAX_TOKEN

_L = LOCK_TABLE


@lru_cache(maxsize=8)
def acquire_sql(now: str) -> str:
    """The acquire statement (module docstring), ``now`` (``now_sql()``) its clock."""
    # The ODKU's first assignment reads the clock and the row once, into user variables,
    # and only then may the row change: @distlock_ok is whether this grant happens.
    decide = (
        f"(@distlock_now := {now}) IS NOT NULL "
        f"AND (@distlock_prev := IF({_L}.owner <> '', {_L}.holder, '')) IS NOT NULL "
        f"AND (@distlock_ok := ({_L}.token < {MAX_TOKEN} "
        f"AND ({_L}.owner = '' OR IFNULL({_L}.expires_us, 0) <= @distlock_now)))"
    )
    return (
        f"INSERT INTO {_L} "
        "(name, token, owner, holder, acquired_us, renewed_us, expires_us, renew_count) "
        f"SELECT %s, token + 1, %s, %s, @distlock_now := {now}, NULL, @distlock_now + %s, 0 "
        f"FROM {FLOOR_TABLE} WHERE id = {FLOOR_ID} AND token < {MAX_TOKEN} "
        "AND (@distlock_prev := '') = '' LOCK IN SHARE MODE "
        "ON DUPLICATE KEY UPDATE "
        f"{_L}.acquired_us = IF({decide}, @distlock_now, {_L}.acquired_us), "
        f"{_L}.token = IF(@distlock_ok, {_L}.token + 1, {_L}.token), "
        f"{_L}.owner = IF(@distlock_ok, VALUES(owner), {_L}.owner), "
        f"{_L}.holder = IF(@distlock_ok, VALUES(holder), {_L}.holder), "
        f"{_L}.renewed_us = IF(@distlock_ok, NULL, {_L}.renewed_us), "
        f"{_L}.expires_us = IF(@distlock_ok, @distlock_now + %s, {_L}.expires_us), "
        f"{_L}.renew_count = IF(@distlock_ok, 0, {_L}.renew_count) "
        "RETURNING token, owner, holder, acquired_us, expires_us, @distlock_prev, @distlock_now"
    )


@lru_cache(maxsize=8)
def renew_sql(now: str) -> str:
    """The renew statement with ``now`` as the clock."""
    return (
        f"UPDATE {_L} SET renewed_us = LAST_INSERT_ID(@distlock_now), "
        "expires_us = renewed_us + %s, renew_count = renew_count + 1 "
        "WHERE name = %s AND owner = CAST(%s AS BINARY) AND token = %s "
        f"AND expires_us > (@distlock_now := {now})"
    )


@lru_cache(maxsize=8)
def release_sql(now: str) -> str:
    """The release statement with ``now`` as the clock."""
    return (
        f"UPDATE {_L} SET owner = '', holder = '', expires_us = LAST_INSERT_ID("
        f"2 * (@distlock_now := {now}) + COALESCE(expires_us > @distlock_now, 0)) DIV 2 "
        "WHERE name = %s AND owner = CAST(%s AS BINARY) AND token = %s"
    )


# Why a renewal was refused, read after the refusal (a plain read: the decision is made).
REFUSED = f"SELECT owner = CAST(%s AS BINARY) AND token = %s FROM {_L} WHERE name = %s"
