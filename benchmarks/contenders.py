"""The locks being compared: distlock and the reference designs, one class each.

Every contender is built in the parent and used in a forked worker: ``connect()`` opens
the worker's own connection, ``try_acquire(name)`` makes one non-blocking try and
returns a handle (or None when the lock is busy), ``release(handle)`` frees it.
Reference SQL follows research/anchors-performance.md so the figures are comparable.
"""

from __future__ import annotations

import uuid
import zlib
from typing import Any

TTL_S = 30
TTL_MS = TTL_S * 1000

# The reference lock table ("A", "B"): the smallest schema a token lock needs.
PG_REF_TABLE = """
CREATE TABLE IF NOT EXISTS bench_lock (
    name text PRIMARY KEY,
    owner text NOT NULL DEFAULT '',
    token bigint NOT NULL DEFAULT 0,
    expires_at timestamptz NOT NULL DEFAULT '-infinity'
)"""
MARIA_REF_TABLE = """
CREATE TABLE IF NOT EXISTS bench_lock (
    name varchar(255) COLLATE utf8mb4_nopad_bin PRIMARY KEY,
    owner varchar(32) NOT NULL DEFAULT '',
    token bigint NOT NULL DEFAULT 0,
    expires_at datetime(6) NOT NULL DEFAULT '1970-01-01 00:00:01'
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"""
SQLITE_REF_TABLE = """
CREATE TABLE IF NOT EXISTS bench_lock (
    name text PRIMARY KEY,
    owner text NOT NULL DEFAULT '',
    token integer NOT NULL DEFAULT 0,
    expires_at real NOT NULL DEFAULT 0
)"""


def new_owner() -> str:
    return uuid.uuid4().hex


class Contender:
    """One lock design. ``label`` is the row name in the table."""

    label = ""
    # What the figure means in the table's notes.
    note = ""
    # The scenarios it runs in (None: all of its section's).
    scenarios: tuple[str, ...] | None = None
    # try_acquire waits for the lock instead of trying once: every call's duration is
    # its wait-to-grant.
    blocks = False

    def connect(self) -> None:
        raise NotImplementedError

    def try_acquire(self, name: str) -> Any:
        raise NotImplementedError

    def release(self, handle: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Distlock(Contender):
    """distlock's public API: ``acquire(blocking=False)`` and ``Lease.release()``."""

    def __init__(self, alias: str, label: str = "distlock", **settings: Any) -> None:
        self.alias = alias
        self.label = label
        self.note = "acquire(blocking=False) + Lease.release() through Django"
        # DISTLOCK_* settings of this contender's workers (e.g. a row without prepared
        # statements).
        self.settings = settings

    def connect(self) -> None:
        from django.db import connections
        from django.test.utils import override_settings

        if self.settings:
            override_settings(**self.settings).enable()  # a forked worker: never undone
        connections[self.alias].ensure_connection()

    def try_acquire(self, name: str) -> Any:
        from distlock import acquire

        return acquire(name, ttl=TTL_S, blocking=False, using=self.alias)

    def release(self, handle: Any) -> None:
        handle.release()

    def close(self) -> None:
        from django.db import connections

        connections.close_all()


def use_mariadb_python_path() -> None:
    """In a forked worker only: run distlock's MariaDB operations without their stored
    procedures (migration 0003) — a transaction of the portable statements from Python,
    and the fenced write's check as a separate locking read — so both paths are measured
    in the same run."""
    from distlock.backends import backend_named

    backend = backend_named("mysql")
    assert backend is not None
    backend.one_statement = frozenset({"holds"})  # type: ignore[misc]
    backend.folded_owner_check = lambda connection: None  # type: ignore[method-assign]


class DistlockPythonPath(Distlock):
    """M: distlock without its procedures (see :func:`use_mariadb_python_path`)."""

    def __init__(self, alias: str) -> None:
        super().__init__(alias, "distlock, Python path (no procedures)")
        self.note = "a transaction of 3–5 statements from Python per operation"

    def connect(self) -> None:
        super().connect()
        use_mariadb_python_path()


class DistlockBlocking(Distlock):
    """distlock's blocking ``acquire()``, as a user waits: back-off, and on PostgreSQL a
    NOTIFY from the release wakes the waiter. One name only: elsewhere it never waits."""

    label = "distlock, blocking acquire"
    scenarios = ("contend",)
    blocks = True

    def __init__(self, alias: str) -> None:
        super().__init__(alias, self.label)
        self.note = "acquire(timeout=10) + Lease.release(): waits instead of spinning"

    def try_acquire(self, name: str) -> Any:
        from distlock import acquire

        return acquire(name, ttl=TTL_S, timeout=10, using=self.alias)


class DjangoDbMutex(Contender):
    """django-db-mutex 3.1: DELETE expired rows + INSERT; a refusal is an IntegrityError."""

    label = "D django-db-mutex"
    note = "ORM DELETE of expired rows + INSERT; no fencing token"

    def connect(self) -> None:
        from django.db import connection

        connection.ensure_connection()

    def try_acquire(self, name: str) -> Any:
        from db_mutex.db_mutex import db_mutex
        from db_mutex.exceptions import DBMutexError

        mutex = db_mutex(name)
        try:
            mutex.start()
        except DBMutexError:
            return None
        return mutex

    def release(self, handle: Any) -> None:
        handle.stop()

    def close(self) -> None:
        from django.db import connections

        connections.close_all()


class _Psycopg(Contender):
    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.conn: Any = None

    def connect(self) -> None:
        import psycopg

        self.conn = psycopg.connect(self.conninfo, autocommit=True)
        self.cur = self.conn.cursor()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class PgUpsert(_Psycopg):
    """A: one INSERT … ON CONFLICT DO UPDATE … RETURNING token; release by owner+token."""

    label = "A pg upsert (psycopg)"
    note = "1 statement + 1 statement, autocommit, prepared: the reference"
    ACQUIRE = (
        "INSERT INTO bench_lock AS l (name, owner, token, expires_at) "
        "VALUES (%s, %s, 1, now() + make_interval(secs => %s)) "
        "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, token = l.token + 1, "
        "expires_at = excluded.expires_at "
        "WHERE l.expires_at < now() OR l.owner = '' RETURNING token"
    )
    RELEASE = "UPDATE bench_lock SET owner = '' WHERE name = %s AND owner = %s AND token = %s"

    def try_acquire(self, name: str) -> Any:
        owner = new_owner()
        row = self.cur.execute(self.ACQUIRE, (name, owner, TTL_S)).fetchone()
        return None if row is None else (name, owner, row[0])

    def release(self, handle: Any) -> None:
        self.cur.execute(self.RELEASE, handle)


class PgSelectForUpdate(_Psycopg):
    """B: BEGIN; SELECT … FOR UPDATE; UPDATE; COMMIT, for acquire and for release."""

    label = "B pg select-for-update (psycopg)"
    note = "the requested design in raw SQL: 4 statements per operation"

    def connect(self) -> None:
        super().connect()
        self.conn.autocommit = False

    def try_acquire(self, name: str) -> Any:
        cur = self.cur
        row = cur.execute(
            "SELECT owner, token, expires_at < clock_timestamp() FROM bench_lock "
            "WHERE name = %s FOR UPDATE", (name,)
        ).fetchone()
        owner = new_owner()
        if row is None:
            cur.execute(
                "INSERT INTO bench_lock (name, owner, token, expires_at) VALUES "
                "(%s, %s, 1, clock_timestamp() + make_interval(secs => %s)) "
                "ON CONFLICT (name) DO NOTHING", (name, owner, TTL_S),
            )
            self.conn.commit()
            return (name, owner, 1) if cur.rowcount == 1 else None
        if row[0] and not row[2]:
            self.conn.commit()
            return None
        cur.execute(
            "UPDATE bench_lock SET owner = %s, token = token + 1, "
            "expires_at = clock_timestamp() + make_interval(secs => %s) WHERE name = %s",
            (owner, TTL_S, name),
        )
        self.conn.commit()
        return (name, owner, row[1] + 1)

    def release(self, handle: Any) -> None:
        name, owner, token = handle
        cur = self.cur
        row = cur.execute(
            "SELECT owner, token FROM bench_lock WHERE name = %s FOR UPDATE", (name,)
        ).fetchone()
        if row is not None and (row[0], row[1]) == (owner, token):
            cur.execute("UPDATE bench_lock SET owner = '' WHERE name = %s", (name,))
        self.conn.commit()


class PgAdvisory(_Psycopg):
    """E: pg_try_advisory_lock / pg_advisory_unlock (no TTL, no token, session-bound)."""

    label = "E pg advisory lock"
    note = "no table, no WAL, no token; lost with the session"

    def try_acquire(self, name: str) -> Any:
        key = zlib.crc32(name.encode())
        ok = self.cur.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0]
        return key if ok else None

    def release(self, handle: Any) -> None:
        self.cur.execute("SELECT pg_advisory_unlock(%s)", (handle,))


class RedisSetNx(Contender):
    """F1: SET key owner NX PX ttl; release by a Lua compare-and-delete (EVALSHA)."""

    label = "F1 redis SET NX PX"
    note = "not durable (no commit to disk), no fencing token"
    RELEASE = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('del', KEYS[1]) else return 0 end"
    )

    def __init__(self, url: str) -> None:
        self.url = url

    def connect(self) -> None:
        import redis

        self.client = redis.Redis.from_url(self.url)
        self.client.ping()
        self.script = self.client.register_script(self.RELEASE)

    def try_acquire(self, name: str) -> Any:
        key = f"distlock-bench:{name}"
        owner = new_owner()
        if self.client.set(key, owner, nx=True, px=TTL_MS):
            return key, owner
        return None

    def release(self, handle: Any) -> None:
        key, owner = handle
        self.script(keys=[key], args=[owner])

    def close(self) -> None:
        self.client.close()


class MariaUpsert(Contender):
    """M.A: one INSERT … ON DUPLICATE KEY UPDATE; the token comes back as LAST_INSERT_ID.

    The guard is evaluated once into ``@ok`` before any column changes (MariaDB applies
    the assignments left to right), and ``LAST_INSERT_ID(expr)`` puts the new token in the
    OK packet, so one round trip tells both "granted?" and the token.
    """

    label = "A mariadb upsert (mysqlclient)"
    note = "1 statement + 1 statement, autocommit: the MariaDB reference"
    ACQUIRE = (
        "INSERT INTO bench_lock (name, owner, token, expires_at) "
        "VALUES (%s, %s, LAST_INSERT_ID(1), SYSDATE(6) + INTERVAL %s SECOND) "
        "ON DUPLICATE KEY UPDATE "
        "token = IF(@ok := (expires_at < SYSDATE(6) OR owner = ''), "
        "LAST_INSERT_ID(token + 1), token), "
        "owner = IF(@ok, VALUES(owner), owner), "
        "expires_at = IF(@ok, VALUES(expires_at), expires_at)"
    )
    RELEASE = "UPDATE bench_lock SET owner = '' WHERE name = %s AND owner = %s AND token = %s"

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params

    def connect(self) -> None:
        import MySQLdb

        self.conn = MySQLdb.connect(**self.params, autocommit=True, charset="utf8mb4")
        self.cur = self.conn.cursor()

    def try_acquire(self, name: str) -> Any:
        owner = new_owner()
        changed = self.cur.execute(self.ACQUIRE, (name, owner, TTL_S))
        # 1: inserted, 2: updated, 0: the guard kept the row as it was (busy).
        if changed == 0:
            return None
        return name, owner, self.cur.lastrowid

    def release(self, handle: Any) -> None:
        self.cur.execute(self.RELEASE, handle)

    def close(self) -> None:
        self.conn.close()


class MariaRawCall(Contender):
    """distlock's own stored procedures called by raw mysqlclient: no Django, no distlock
    Python. Same guarantees as distlock (it is distlock's server side); what it costs
    beside A is the server's price of the CALL, and distlock beside it is the price of the
    Python layer (issue 33's "limit measured with a reference with the same guarantees")."""

    label = "distlock's CALLs (raw mysqlclient)"
    note = "CALL distlock_acquire + CALL distlock_release, autocommit, no Django"
    HOLDER = "bench pid=0 thread=MainThread"  # as long as distlock's own holder text

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params

    def connect(self) -> None:
        import MySQLdb

        from distlock.constants import MAX_TOKEN

        self.max_token = MAX_TOKEN
        self.conn = MySQLdb.connect(**self.params, autocommit=True, charset="utf8mb4")
        self.cur = self.conn.cursor()

    def _call(self, sql: str, args: tuple[Any, ...]) -> Any:
        self.cur.execute(sql, args)
        row = self.cur.fetchone()
        while self.cur.nextset():
            pass
        return row

    def try_acquire(self, name: str) -> Any:
        owner = new_owner()
        row = self._call("CALL distlock_acquire(%s, %s, %s, %s, %s)",
                         (name, owner, self.HOLDER, TTL_S * 1_000_000, self.max_token))
        if row[0] != "granted":
            return None
        return name, owner, row[1]

    def release(self, handle: Any) -> None:
        self._call("CALL distlock_release(%s, %s, %s)", handle)

    def close(self) -> None:
        self.conn.close()


class SqliteUpsert(Contender):
    """S.A: A's upsert in SQLite (autocommit, WAL, synchronous=FULL, busy timeout 5 s)."""

    label = "A sqlite upsert (sqlite3)"
    note = "A's statement in-process: the SQLite reference"
    ACQUIRE = (
        "INSERT INTO bench_lock AS l (name, owner, token, expires_at) "
        "VALUES (?, ?, 1, julianday('now') + ?) "
        "ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, token = l.token + 1, "
        "expires_at = excluded.expires_at "
        "WHERE l.expires_at < julianday('now') OR l.owner = '' RETURNING token"
    )
    RELEASE = "UPDATE bench_lock SET owner = '' WHERE name = ? AND owner = ? AND token = ?"

    def __init__(self, path: str) -> None:
        self.path = path

    def connect(self) -> None:
        import sqlite3

        self.conn = sqlite3.connect(self.path, timeout=5, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")

    def try_acquire(self, name: str) -> Any:
        owner = new_owner()
        row = self.conn.execute(self.ACQUIRE, (name, owner, TTL_S / 86400)).fetchone()
        return None if row is None else (name, owner, row[0])

    def release(self, handle: Any) -> None:
        self.conn.execute(self.RELEASE, handle)

    def close(self) -> None:
        self.conn.close()


class _AccountWrite(Contender):
    """One write of a worker's own BenchAccount row per "cycle"; release does nothing.

    The "own" scenario gives worker i the name ``own:i``: it writes row i + 1, holding
    the lease of that row's lock for the whole measurement (acquired at the first write).
    """

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.leases: dict[int, Any] = {}

    def connect(self) -> None:
        from django.db import connections

        connections[self.alias].ensure_connection()

    def _row(self, name: str) -> int:
        return int(name.split(":")[1]) + 1

    def _lease(self, pk: int) -> Any:
        if pk not in self.leases:
            from distlock import acquire

            lease = acquire(f"bench-account:{pk}", ttl=3600, timeout=30, using=self.alias)
            if lease is None:
                raise RuntimeError(
                    f"bench-account:{pk} is held by someone else (a run killed earlier?): "
                    "break it with `manage.py distlock_break` on the benchmark database"
                )
            self.leases[pk] = lease
        return self.leases[pk]

    def release(self, handle: Any) -> None:
        pass

    def close(self) -> None:
        from django.db import connections

        for lease in self.leases.values():
            lease.release()
        connections.close_all()


class PlainUpdate(_AccountWrite):
    label = "plain update()"
    note = "BenchAccount.objects.filter(pk=…).update(balance=F('balance') + 1)"

    def try_acquire(self, name: str) -> Any:
        from django.db.models import F

        from benchmarks.benchapp.models import BenchAccount

        return BenchAccount.objects.using(self.alias).filter(pk=self._row(name)).update(
            balance=F("balance") + 1
        )


class FencedUpdate(_AccountWrite):
    label = "fenced_update(lease)"
    note = "ownership check (locking read) + conditional UPDATE in one transaction"

    def try_acquire(self, name: str) -> Any:
        from django.db.models import F

        from benchmarks.benchapp.models import BenchAccount

        pk = self._row(name)
        return BenchAccount.objects.using(self.alias).filter(pk=pk).fenced_update(
            self._lease(pk), balance=F("balance") + 1
        )


class FencedSave(_AccountWrite):
    label = "save(fence=lease)"
    note = "Model.save with the fence (the object is re-read once, then saved each time)"

    def try_acquire(self, name: str) -> Any:
        from benchmarks.benchapp.models import BenchAccount

        pk = self._row(name)
        if not hasattr(self, "objects"):
            self.objects: dict[int, Any] = {}
        account = self.objects.get(pk)
        if account is None:
            account = self.objects[pk] = BenchAccount.objects.using(self.alias).get(pk=pk)
        account.balance += 1
        account.save(fence=self._lease(pk), using=self.alias)
        return True


class FencedUpdateSeparateCheck(FencedUpdate):
    """MariaDB before the folded check: a locking read, then the UPDATE, in a transaction."""

    label = "fenced_update(lease), separate check (before)"
    note = "SELECT … LOCK IN SHARE MODE + conditional UPDATE in one transaction"

    def connect(self) -> None:
        super().connect()
        use_mariadb_python_path()


class MariaRawUpdate(_AccountWrite):
    """The server's own floor: a worker's row updated by raw mysqlclient, no Django."""

    label = "raw UPDATE (mysqlclient)"
    note = "UPDATE … SET balance = balance + 1 WHERE id = %s, autocommit, no Django"
    SQL = "UPDATE benchapp_benchaccount SET balance = balance + 1 WHERE id = %s"

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias)
        self.params = params

    def connect(self) -> None:
        import MySQLdb

        super().connect()
        self.conn = MySQLdb.connect(**self.params, autocommit=True, charset="utf8mb4")
        self.cur = self.conn.cursor()

    def try_acquire(self, name: str) -> Any:
        changed = self.cur.execute(self.SQL, (self._row(name),))
        assert changed == 1, f"row {self._row(name)} was not updated"
        return True

    def close(self) -> None:
        self.conn.close()
        super().close()


class MariaRawFencedUpdate(MariaRawUpdate):
    """The same UPDATE with distlock's guarantees written by hand: the fence token's
    high-water mark and the lease's ownership as a locking sub-select (what distlock's
    MariaDB fenced write sends). Its cost over the raw UPDATE is what the server charges
    for the check, whatever the client library: the limit of a fenced write there."""

    label = "raw UPDATE + ownership sub-select (mysqlclient)"
    note = "the same UPDATE with fence_token <= token AND EXISTS(… LOCK IN SHARE MODE)"
    SQL = (
        "UPDATE benchapp_benchaccount SET balance = balance + 1, fence_token = %s "
        "WHERE id = %s AND fence_token <= %s AND EXISTS (SELECT 1 FROM distlock_lock "
        "WHERE name = %s AND owner = CAST(%s AS BINARY) AND token = %s AND expires_us > "
        "CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED) LOCK IN SHARE MODE)"
    )

    def try_acquire(self, name: str) -> Any:
        pk = self._row(name)
        lease = self._lease(pk)
        changed = self.cur.execute(
            self.SQL, (lease.token, pk, lease.token, lease.name, lease.owner, lease.token)
        )
        assert changed == 1, f"the fenced write of row {pk} was refused"
        return True
