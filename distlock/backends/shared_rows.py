"""The SQL of the locks several holders share: semaphores and read/write locks.

Both are ordinary lock rows (docs/semaphores.md, docs/rwlocks.md): a **head row** that is
never held, whose ``token`` is the last token granted under the name and which every
grant locks first, and **member rows** (a semaphore's permits; a read/write lock's
writer and readers), each held like a lock. One grant is one transaction: the head row
locked for writing, the member rows read with a locking read, the database clock read
after both, then one member row granted and the head's token set to the new token. A
grant's token is one above the largest token the head or any member row has, so tokens
rise strictly per name whatever row a grant takes (a member row kept past a purge of the
head included). Renewal, release, break and expiry of a member row are the lock's own
operations on that row: they lock only the row, which is why a grant reads the rows with
a locking read (it waits for a release in flight) and judges them by a clock read after.

Portable SQL, a base of :class:`~distlock.backends.base.Backend`; SQLite runs it in its
``BEGIN IMMEDIATE`` transaction (sqlite.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

from distlock.backends.results import Busy, Grant, exhausted
from distlock.constants import LOCK_TABLE as TABLE
from distlock.constants import MAX_TOKEN

_COLUMNS = "(name, token, owner, holder, acquired_us, renewed_us, expires_us, renew_count)"


class Member(NamedTuple):
    """One member row as a grant read it."""

    token: int
    owner: str
    holder: str
    expires_us: int | None

    def held_at(self, now_us: int) -> bool:
        return bool(self.owner) and self.expires_us is not None and self.expires_us > now_us


class Head(NamedTuple):
    """The head row, locked for writing: the last token, its ``holder`` (a semaphore's
    "permits=N"; a read/write lock's waiting writer), ``expires_us`` (a waiting writer's
    intent lasts until then) and ``renew_count`` (a semaphore's permit rows so far)."""

    token: int
    holder: str
    expires_us: int | None
    rows: int


class SharedRowsSQL:
    """Grants of semaphores and read/write locks (see the module docstring)."""

    #: Declared by :class:`~distlock.backends.base.Backend`.
    for_update: ClassVar[str]
    share_lock: ClassVar[str]

    def now_sql(self) -> str:
        raise NotImplementedError

    def now(self, cursor: Any) -> int:
        raise NotImplementedError

    def floor(self, cursor: Any, lock: str) -> int:
        raise NotImplementedError

    def insert_if_absent(
        self, table: str, columns: str, values: str, *, key: str = "name"
    ) -> str:
        raise NotImplementedError

    def update_row(
        self, cursor: Any, name: str, changes: str, condition: str, params: list[Any], *,
        returning: str,
    ) -> Any:
        raise NotImplementedError

    # -- the steps -------------------------------------------------------------------

    def lock_head(self, cursor: Any, head: str, holder: str) -> Head:
        """The head row locked for writing, created (free, at the token floor) if missing.

        Created with ``holder``; the floor is read under a share lock, as a new lock row's
        is (Backend.acquire_new), so a purge cannot lower it meanwhile."""
        sql = (
            f"SELECT token, holder, expires_us, renew_count FROM {TABLE} WHERE name = %s"
            + self.for_update
        )
        cursor.execute(sql, [head])
        row = cursor.fetchone()
        if row is None:
            top = self.floor(cursor, self.share_lock)
            now = self.now_sql()
            cursor.execute(
                self.insert_if_absent(
                    TABLE, _COLUMNS, f"VALUES (%s, %s, '', %s, NULL, NULL, {now}, 0)"
                ),
                [head, top, holder],
            )
            cursor.execute(sql, [head])
            row = cursor.fetchone()
        return Head(int(row[0]), str(row[1]), row[2], int(row[3]))

    def read_members(self, cursor: Any, names: Sequence[str]) -> dict[str, Member]:
        """The member rows that exist among ``names``, with a locking read (shared): it
        waits for a release, renewal or break of one of them in flight."""
        marks = ", ".join(["%s"] * len(names))
        cursor.execute(
            f"SELECT name, token, owner, holder, expires_us FROM {TABLE} "
            f"WHERE name IN ({marks}){self.share_lock}",
            list(names),
        )
        return {
            str(name): Member(int(token), str(owner), str(holder), expires_us)
            for name, token, owner, holder, expires_us in cursor.fetchall()
        }

    def grant_member(
        self, cursor: Any, name: str, row: Member | None, token: int, owner: str,
        holder: str, ttl_us: int,
    ) -> Grant | None:
        """Grant member row ``name`` with ``token``: update it if it is free or expired,
        create it if missing. None: it was taken (or created) by someone else meanwhile —
        only a plain ``acquire`` of the row's name can do that, grants hold the head."""
        if row is None:
            now = self.now_sql()
            cursor.execute(
                self.insert_if_absent(
                    TABLE, _COLUMNS, f"VALUES (%s, %s, %s, %s, {now}, NULL, {now} + %s, 0)"
                ),
                [name, token, owner, holder, ttl_us],
            )
            if cursor.rowcount != 1:
                return None
            cursor.execute(
                f"SELECT token, acquired_us, expires_us FROM {TABLE} WHERE name = %s", [name]
            )
            return Grant(*cursor.fetchone())
        granted = self.update_row(
            cursor, name,
            "token = %s, owner = %s, holder = %s, acquired_us = {now}, renewed_us = NULL, "
            "expires_us = {now} + %s, renew_count = 0",
            "owner = '' OR expires_us <= {now}",
            [token, owner, holder, ttl_us],
            returning="token, acquired_us, expires_us",
        )
        if granted is None:
            return None
        new_token, acquired_us, expires_us = granted
        return Grant(new_token, acquired_us, expires_us, took_over=row.holder if row.owner else "")

    def set_head(
        self, cursor: Any, head: str, token: int, holder: str, rows: int, intent_us: int = 0,
    ) -> None:
        """Write the head: the last token, its holder text, the permit rows so far, and
        ``expires_us`` = now (+ ``intent_us``: a waiting writer's intent)."""
        self.update_row(
            cursor, head,
            "token = %s, holder = %s, renew_count = %s, expires_us = {now} + %s",
            "1 = 1", [token, holder, rows, intent_us], returning="token",
        )

    @staticmethod
    def _top(head: Head, rows: dict[str, Member], name: str) -> int:
        top = max([head.token, *(row.token for row in rows.values())])
        if top >= MAX_TOKEN:
            raise exhausted(name)
        return top

    @staticmethod
    def _busy(top: int, holder: str, held: Sequence[Member], now_us: int) -> Busy:
        ends = [row.expires_us for row in held if row.expires_us is not None]
        remaining = max(0, min(ends) - now_us) if ends else None
        return Busy(top, holder, remaining)

    def _grant_first_free(
        self, cursor: Any, names: Sequence[str], rows: dict[str, Member], now_us: int,
        token: int, owner: str, holder: str, ttl_us: int,
    ) -> tuple[str, Grant] | None:
        """Grant the first free row of ``names``, starting at a random one (so holders
        spread over the rows instead of all meeting on the first)."""
        start = random.randrange(len(names))
        for step in range(len(names)):
            name = names[(start + step) % len(names)]
            row = rows.get(name)
            if row is not None and row.held_at(now_us):
                continue
            grant = self.grant_member(cursor, name, row, token, owner, holder, ttl_us)
            if grant is not None:
                return name, grant
        return None

    # -- the operations (run by db.run) ------------------------------------------------

    def semaphore_grant(
        self, cursor: Any, name: str, head: str, prefix: str, permits: int,
        owner: str, holder: str, ttl_us: int,
    ) -> tuple[str, Grant] | Busy:
        """One permit of semaphore ``name`` (at most ``permits`` held by the database
        clock), or Busy.

        The permit rows are ``prefix`` + 0, 1, …: as many as the name has ever had (at
        least ``permits``) are counted, so a semaphore whose N was lowered grants
        nothing until fewer than the new N hold (holders of rows at or above it finish
        first); only rows below ``permits`` are granted. The head keeps how many rows
        there were (``renew_count``) and the last N (``holder``)."""
        top_head = self.lock_head(cursor, head, f"permits={permits}")
        counted = max(top_head.rows, permits)
        names = [f"{prefix}{index}" for index in range(counted)]
        rows = self.read_members(cursor, names)
        now_us = self.now(cursor)
        top = self._top(top_head, rows, name)
        held = [row for row in rows.values() if row.held_at(now_us)]
        if len(held) >= permits:
            return self._busy(top, f"{len(held)} of {permits} permits held", held, now_us)
        got = self._grant_first_free(
            cursor, names[:permits], rows, now_us, top + 1, owner, holder, ttl_us
        )
        if got is None:
            return self._busy(top, "every permit row is taken", held, now_us)
        self.set_head(cursor, head, top + 1, f"permits={permits}", counted)
        return got

    def rw_grant(
        self, cursor: Any, name: str, head: str, writer: str, readers: Sequence[str],
        write: bool, owner: str, holder: str, ttl_us: int, intent_us: int,
    ) -> tuple[str, Grant] | Busy:
        """The writer row (``write``) or a reader row of read/write lock ``name``, or Busy.

        A writer is granted when no row is held by the database clock; refused, with
        ``intent_us`` > 0 (it will wait), it leaves its intent on the head: ``expires_us``
        that far ahead, its ``holder`` there. A reader is granted while the writer row is
        not held and no writer's intent is current, on a free reader row. Either way the
        token is one above every token of the name, so a writer's is above every
        reader's before it."""
        top_head = self.lock_head(cursor, head, "")
        rows = self.read_members(cursor, [writer, *readers])
        now_us = self.now(cursor)
        top = self._top(top_head, rows, name)
        writing = rows.get(writer)
        if writing is not None and writing.held_at(now_us):
            if write and intent_us:
                self.set_head(cursor, head, top_head.token, holder, 0, intent_us)
            return self._busy(top, writing.holder, [writing], now_us)
        held = [row for key, row in rows.items() if key != writer and row.held_at(now_us)]
        if write:
            if held:
                if intent_us:
                    self.set_head(cursor, head, top_head.token, holder, 0, intent_us)
                return self._busy(top, f"{len(held)} readers", held, now_us)
            got = self._grant_first_free(
                cursor, [writer], rows, now_us, top + 1, owner, holder, ttl_us
            )
        else:
            if top_head.expires_us is not None and top_head.expires_us > now_us:
                remaining = top_head.expires_us - now_us
                return Busy(top, f"a writer waits: {top_head.holder}", remaining)
            got = self._grant_first_free(
                cursor, list(readers), rows, now_us, top + 1, owner, holder, ttl_us
            )
        if got is None:
            return self._busy(top, "every reader row is taken", held, now_us)
        # A writer's grant ends its own intent (a waiting writer renews its own at its
        # next try); a reader's leaves the head's holder as it was.
        self.set_head(cursor, head, top + 1, "" if write else top_head.holder, 0)
        return got
