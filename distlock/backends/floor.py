"""The token floor's SQL: what keeps a purged name that comes back above its old tokens.

New lock rows start one above the floor (``distlock_floor``, one row), which purge raises
to the largest token it may delete, committed before the delete (which takes only rows at
or below it) — O(1) per first use, where
reading the lock table's largest token scanned it. After a failover to a standby that
missed the last commits, :meth:`TokenFloorSQL.raise_tokens` lifts the floor and every
lock row above every token the lost primary can have issued. Portable SQL, a base of
:class:`~distlock.backends.base.Backend`; kept apart because it is one concern of its own.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, ClassVar

from distlock.constants import FLOOR_ID, FLOOR_TABLE, MAX_TOKEN
from distlock.constants import LOCK_TABLE as TABLE
from distlock.exceptions import TokenExhausted


class TokenFloorSQL:
    """Reading and raising the token floor; batched purge (see the module docstring)."""

    #: Declared by :class:`~distlock.backends.base.Backend` (the locking clauses).
    for_update: ClassVar[str]
    share_lock: ClassVar[str]

    def now_sql(self) -> str:
        raise NotImplementedError

    def insert_if_absent(
        self, table: str, columns: str, values: str, *, key: str = "name"
    ) -> str:
        raise NotImplementedError

    def floor(self, cursor: Any, lock: str) -> int:
        """The token floor (see :class:`~distlock.models.TokenFloor`), read with ``lock``
        (``share_lock`` or ``for_update``), which holds until the transaction ends.

        A missing floor row (a ``flush`` empties every table) is put back first, from the
        largest token in the lock table: what new rows started above before the floor.
        """
        sql = f"SELECT token FROM {FLOOR_TABLE} WHERE id = %s{lock}"
        cursor.execute(sql, [FLOOR_ID])
        row = cursor.fetchone()
        if row is None:
            cursor.execute(
                self.insert_if_absent(
                    FLOOR_TABLE, "(id, token)",
                    f"VALUES (%s, (SELECT COALESCE(MAX(token), 0) FROM {TABLE}))", key="id",
                ),
                [FLOOR_ID],
            )
            cursor.execute(sql, [FLOOR_ID])
            row = cursor.fetchone()
        return int(row[0])

    def purge_look(
        self, cursor: Any, idle_us: int, after: str, size: int
    ) -> tuple[list[str], int, str | None]:
        """A purge batch's first transaction: among the ``size`` names that follow
        ``after`` in name order, the rows free or expired for at least ``idle_us``; raise
        the token floor to the largest of their tokens.

        Returns (the idle names, the floor now — the ceiling of what
        :meth:`purge_delete` may delete —, the last name looked at: None once the table's
        end is reached). The look locks no lock row; the floor is locked only for its own
        update and the commit, not for the deletes: a first use of a new name, which
        reads the floor with a share lock, waits for one row's update, not for a batch.
        A floor raised for a row that is then granted instead of deleted is harmless: the
        floor only has to be at or above every token deleted.
        """
        now = self.now_sql()
        cursor.execute(
            f"SELECT name, token, CASE WHEN expires_us <= {now} - %s THEN 1 ELSE 0 END "
            f"FROM {TABLE} WHERE name > %s ORDER BY name LIMIT %s",
            [idle_us, after, size],
        )
        rows = cursor.fetchall()
        last = str(rows[-1][0]) if len(rows) == size else None
        idle = [(str(name), int(token)) for name, token, is_idle in rows if is_idle]
        if not idle:
            return [], 0, last
        floor = self.floor(cursor, self.for_update)
        top = max(token for _, token in idle)
        if top > floor:
            cursor.execute(
                f"UPDATE {FLOOR_TABLE} SET token = %s WHERE id = %s", [top, FLOOR_ID]
            )
        return [name for name, _ in idle], max(top, floor), last

    def purge_delete(
        self, cursor: Any, names: list[str], idle_us: int, ceiling: int
    ) -> int:
        """A purge batch's second transaction: delete those of ``names`` still idle for
        ``idle_us`` whose token is at most ``ceiling`` (the floor committed by
        :meth:`purge_look`); return how many.

        The condition is judged on each row's current version under its row lock, so a
        row granted since the look (a fresh lease, a higher token) stays. Every row
        deleted has a token at or below the floor, which only rises, and a first use
        reads the floor after the delete's commit (its insert of a name being deleted
        waits for it), so a purged name that comes back starts above every token it had.
        No floor lock here: a first use holding the floor's share lock may wait for this
        delete (the name it inserts), and nothing here waits for the floor.
        """
        marks = ", ".join(["%s"] * len(names))
        now = self.now_sql()
        cursor.execute(
            f"DELETE FROM {TABLE} WHERE name IN ({marks}) AND expires_us <= {now} - %s "
            "AND token <= %s",
            [*names, idle_us, ceiling],
        )
        return int(cursor.rowcount)

    def purge_batch(
        self, cursor: Any, idle_us: int, after: str, size: int
    ) -> tuple[int, str | None]:
        """Both steps of a purge batch in one transaction, for a database with one writer
        at a time (SQLite): there a first use waits for the whole database's write lock
        anyway, so a second transaction only makes the purge queue for that lock twice
        per batch, and SQLite's busy handler lets a stream of acquires starve it.
        Returns (rows deleted, the last name looked at)."""
        idle, ceiling, last = self.purge_look(cursor, idle_us, after, size)
        return (self.purge_delete(cursor, idle, idle_us, ceiling) if idle else 0), last

    def batch_transaction(self, connection: Any) -> AbstractContextManager[bool]:
        """The transaction of one purge or retention batch on a database with one writer
        (``single_writer``), begun once it holds the write lock; yields whether the lock
        was taken by someone else when the batch first asked (distlock/core/batches.py)."""
        raise NotImplementedError

    def raise_tokens(
        self, cursor: Any, margin: int
    ) -> tuple[int, int, int, list[tuple[str, str, int, str]]]:
        """Set every lock row's token and the floor to ``top + margin``, where ``top`` is
        the largest token of the table and the floor; end every lease.

        Returns (top, the new floor, rows changed, the leases ended as (name, owner,
        token, holder)). Every grant from then on — of a name with a row (its token + 1)
        or of a new one (the floor + 1) — is above ``top + margin``. Any token the lost
        primary issued is at most ``top`` plus the grants it made that this database never
        received, however they chained through purges and first uses: each grant adds one
        to a token that was there before. So a margin above that count closes the gap.

        Leases are ended because none can be trusted: the lost primary may have released
        one, or let it expire and granted the name again, after what this database shows.
        The floor is locked before any lock row, as in every transaction that takes both,
        so first uses wait for the step; grants of existing rows that slip in before the
        UPDATE reaches their row are overwritten by it (their leases ended too). Raises
        TokenExhausted, changing nothing, if ``top + margin`` would pass MAX_TOKEN.
        """
        floor = self.floor(cursor, self.for_update)
        cursor.execute(f"SELECT COALESCE(MAX(token), 0) FROM {TABLE}", [])
        top = max(floor, int(cursor.fetchone()[0]))
        if top > MAX_TOKEN - margin:
            raise TokenExhausted(
                f"raising the fencing tokens by {margin} would pass {MAX_TOKEN} (the largest "
                f"token so far is {top}); nothing was changed"
            )
        now = self.now_sql()
        held = f"owner <> '' AND expires_us > {now}"
        cursor.execute(
            f"SELECT name, owner, token, holder FROM {TABLE} WHERE {held}{self.for_update}",
            [],
        )
        ended = [(str(n), str(o), int(t), str(h)) for n, o, t, h in cursor.fetchall()]
        # expires_us first: MariaDB/MySQL evaluate SET from left to right, so a CASE after
        # ``owner = ''`` would see the owner already cleared.
        cursor.execute(
            f"UPDATE {TABLE} SET expires_us = CASE WHEN {held} THEN {now} "
            "ELSE expires_us END, token = %s, owner = '', holder = ''",
            [top + margin],
        )
        changed = int(cursor.rowcount)
        cursor.execute(
            f"UPDATE {FLOOR_TABLE} SET token = %s WHERE id = %s", [top + margin, FLOOR_ID]
        )
        return top, top + margin, changed, ended
