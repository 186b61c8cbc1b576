"""The lab's contenders: real lock implementations behind one small interface.

Each runs inside a worker process (lab/worker.py), one per client of a trial:

* ``acquire(ttl, timeout)`` → a token (opaque for Redis and Redlock, an integer that
  grows per grant for etcd and distlock) or None if the lock could not be had within
  ``timeout`` seconds (0: one try);
* ``release()`` → True if the lock was still this client's;
* ``write(key, value)`` → True if the protected resource accepted the write. The resource is
  the same PostgreSQL table for everyone (lab.models.Cell): the unfenced contenders write
  it plainly, etcd as a high-water mark on its revision (the best a lock kept outside the
  resource's database can do), distlock-fenced with ``save(fence=lease)``.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lab.models import LOCK_NAME, Cell

T = TypeVar("T")
POLL = 0.01  # seconds between two tries of a blocking acquire
ETCD_RETRY = 15.0  # seconds an etcd call is tried again through an election or a lost member


def read(key: str) -> int:
    return int(Cell.objects.values_list("value", flat=True).get(pk=key))


def plain_write(key: str, value: int) -> bool:
    return bool(Cell.objects.filter(pk=key).update(value=value) == 1)


def redis_client(port: int, host: str = "127.0.0.1") -> Any:
    """A redis-py client that sends each command once.

    redis-py 6+ retries a command on a connection error, three times with back-off, by
    default. pottery returns as soon as it has a quorum and leaves the other masters'
    SETs running, so a retried SET to a master that was down lands seconds after the
    grant, once that master is back (the clock scenario). The lab's acquire loops retry.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis(port=port, host=host, socket_timeout=2, socket_connect_timeout=1,
                       retry=Retry(NoBackoff(), 0))


def polling(attempt: Callable[[], T | None], timeout: float) -> T | None:
    """``attempt()`` until it gives something or ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        got = attempt()
        if got is not None or time.monotonic() >= deadline:
            return got
        time.sleep(POLL)


class Contender:
    """The interface; ``fenced`` says whether its writes carry the token to the resource."""

    name = ""
    fenced = False

    def acquire(self, ttl: float, timeout: float) -> Any:
        raise NotImplementedError

    def release(self) -> bool:
        raise NotImplementedError

    def write(self, key: str, value: int) -> bool:
        return plain_write(key, value)


class RedisLock(Contender):
    """redis-py's ``Lock`` (SET NX PX, a Lua-checked release) on one redis-server.

    With ``master_file`` (the failover scenario) the client asks that file which port is
    the master after a connection error, as a Sentinel-aware client asks Sentinel.
    ``host``: where the servers are reached (the partition scenario's holder reaches them
    over its link).
    """

    name = "redis"

    def __init__(self, ports: list[int], master_file: str = "", host: str = "127.0.0.1") -> None:
        import redis

        self.redis = redis
        self.master_file = master_file
        self.host = host
        self.port = ports[0]
        self.client = redis_client(self.port, host)
        self.lock: Any = None
        self.ttl = 0.0

    def follow(self) -> None:
        """After a connection error: the master now named by ``master_file``, if another."""
        try:
            with open(self.master_file) as current:
                port = int(current.read())
        except (OSError, ValueError):
            return  # no failover in this scenario
        if port != self.port:
            self.port, self.client = port, redis_client(port, self.host)
            if self.lock is not None:
                token = self.lock.local.token
                self.lock = self.client.lock(LOCK_NAME, timeout=self.ttl)
                self.lock.local.token = token

    def acquire(self, ttl: float, timeout: float) -> Any:
        self.ttl = ttl
        self.lock = None
        self.follow()  # the master of now, as a client asks Sentinel when it connects
        self.lock = self.client.lock(LOCK_NAME, timeout=ttl)

        def attempt() -> str | None:
            try:
                if self.lock.acquire(blocking=False):
                    return str(self.lock.local.token.decode())
            except self.redis.ConnectionError:
                self.follow()  # a restarted server: the pool reconnects on the next try
            return None

        return polling(attempt, timeout)

    def release(self) -> bool:
        for _ in range(2):
            try:
                self.lock.release()
                return True
            except self.redis.exceptions.LockError:
                return False
            except self.redis.ConnectionError:
                self.follow()
        return False


class Redlock(Contender):
    """pottery's ``Redlock`` over five independent redis-servers (quorum three)."""

    name = "redlock"

    def __init__(self, ports: list[int], host: str = "127.0.0.1") -> None:
        from pottery import Redlock as PotteryRedlock
        from pottery import ReleaseUnlockedLock

        # pottery logs every unreachable master with its traceback (the clock scenario
        # takes two down on purpose); the outcome is what the lab reads.
        logging.getLogger("pottery").setLevel(logging.CRITICAL)
        self.factory = PotteryRedlock
        self.unlocked = ReleaseUnlockedLock
        self.masters = {redis_client(port, host) for port in ports}
        self.lock: Any = None

    def acquire(self, ttl: float, timeout: float) -> Any:
        self.lock = self.factory(key=LOCK_NAME, masters=self.masters, auto_release_time=ttl)

        def attempt() -> str | None:
            return str(self.lock._uuid) if self.lock.acquire(blocking=False) else None

        return polling(attempt, timeout)

    def release(self) -> bool:
        try:
            self.lock.release()
            return True
        except self.unlocked:
            return False


class EtcdLock(Contender):
    """A lease and a create-if-absent transaction through etcd's v3 JSON gateway.

    The lock is key ``lab-resource`` attached to a lease of ``ttl`` seconds (etcd takes
    whole seconds, and at least its minimum); the grant is the transaction that created the
    key, and its revision is the fencing token: etcd gives every write a higher revision.
    No keep-alive: like the other contenders, the lease runs out ``ttl`` after the grant.
    The resource keeps the highest revision that wrote a row and refuses lower ones.
    """

    name = "etcd"
    fenced = True
    KEY = base64.b64encode(LOCK_NAME.encode()).decode()

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.at = 0  # the member this client talks to: endpoints[0] until it is lost
        self.conn = self.connect()
        self.lease = 0
        self.token = 0

    def connect(self) -> http.client.HTTPConnection:
        host, port = self.endpoints[self.at].rsplit(":", 1)
        return http.client.HTTPConnection(host, int(port), timeout=10)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One gateway call. A dropped keep-alive connection is opened again; a member that
        cannot be reached (the lab's etcd-member scenario kills it) is left for the next
        endpoint, as etcd's clients do; an answer of "no leader yet" (an election) is asked
        again; for up to ETCD_RETRY seconds."""
        deadline = time.monotonic() + ETCD_RETRY
        while True:
            try:
                self.conn.request("POST", path, json.dumps(body),
                                  {"Content-Type": "application/json"})
                answer = self.conn.getresponse()
                data: dict[str, Any] = json.loads(answer.read() or b"{}")
                if answer.status == 200:
                    return data
                if answer.status < 500 or time.monotonic() >= deadline:
                    raise RuntimeError(f"etcd {path}: {answer.status} {data}")
            except (http.client.HTTPException, ConnectionError, TimeoutError):
                self.conn.close()
                if time.monotonic() >= deadline:
                    raise
                if isinstance(sys.exc_info()[1], ConnectionRefusedError):
                    self.at = (self.at + 1) % len(self.endpoints)
                    self.conn = self.connect()
            time.sleep(POLL)

    def acquire(self, ttl: float, timeout: float) -> Any:
        seconds = max(1, math.ceil(ttl))
        if self.at != 0:  # back to the first member (the etcd-member scenario restarted it)
            self.conn.close()
            self.at = 0
            self.conn = self.connect()

        def attempt() -> int | None:
            lease = int(self.call("/v3/lease/grant", {"TTL": seconds})["ID"])
            answer = self.call("/v3/kv/txn", {
                "compare": [{"key": self.KEY, "target": "CREATE", "result": "EQUAL",
                             "create_revision": "0"}],
                "success": [{"request_put": {"key": self.KEY, "value": "", "lease": lease}}],
            })
            if answer.get("succeeded"):
                self.lease, self.token = lease, int(answer["header"]["revision"])
                return self.token
            # Not granted: this lease goes, so the next try's lease starts its ttl anew.
            self.call("/v3/lease/revoke", {"ID": lease})
            return None

        return polling(attempt, timeout)

    def release(self) -> bool:
        answer = self.call("/v3/kv/txn", {
            "compare": [{"key": self.KEY, "target": "CREATE", "result": "EQUAL",
                         "create_revision": str(self.token)}],
            "success": [{"request_delete_range": {"key": self.KEY}}],
        })
        with contextlib.suppress(RuntimeError):  # already gone with its expired lease
            self.call("/v3/lease/revoke", {"ID": self.lease})
        return bool(answer.get("succeeded"))

    def write(self, key: str, value: int) -> bool:
        # The table's own conditional write, as any store outside distlock would do it
        # (distlock's queryset keeps fence_token for its fenced writes).
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("UPDATE lab_cell SET value = %s, fence_token = %s "
                           "WHERE key = %s AND fence_token <= %s",
                           [value, self.token, key, self.token])
            return bool(cursor.rowcount == 1)


RECONNECT = 60.0  # seconds a distlock client keeps trying to reach a primary again


def reconnecting(operation: Callable[[], T], deadline: float) -> T:
    """``operation()``, again on a fresh connection while the database cannot be reached
    (its primary died, the promoted standby still refuses the application), until
    ``deadline`` (monotonic). What an application's retry does in the PostgreSQL failover
    scenarios; elsewhere the first try succeeds."""
    from django.db import InterfaceError, OperationalError, connection

    while True:
        try:
            return operation()
        except (OperationalError, InterfaceError):
            connection.close()  # Django does not reopen a broken connection by itself
            if time.monotonic() >= deadline:
                raise
            time.sleep(POLL * 5)


class Distlock(Contender):
    """distlock's ``acquire`` on PostgreSQL; the writes ignore the lease (the lock alone)."""

    name = "distlock"

    def __init__(self) -> None:
        self.lease: Any = None

    def acquire(self, ttl: float, timeout: float) -> Any:
        import distlock

        deadline = time.monotonic() + max(timeout, RECONNECT)
        end = time.monotonic() + timeout

        def attempt() -> Any:
            left = end - time.monotonic()
            if left > 0:
                return distlock.acquire(LOCK_NAME, ttl=ttl, timeout=left)
            return distlock.acquire(LOCK_NAME, ttl=ttl, blocking=False)

        self.lease = reconnecting(attempt, deadline)
        return None if self.lease is None else int(self.lease.token)

    def release(self) -> bool:
        return bool(reconnecting(self.lease.release, time.monotonic() + RECONNECT))

    def write(self, key: str, value: int) -> bool:
        return reconnecting(lambda: plain_write(key, value), time.monotonic() + RECONNECT)


class DistlockFenced(Distlock):
    """The same lock, and every write is ``save(fence=lease)``: the high-water mark and
    the ownership check in the writing transaction (the lock row, by the database clock)."""

    name = "distlock-fenced"
    fenced = True

    def write(self, key: str, value: int) -> bool:
        from distlock import StaleToken

        def fenced() -> bool:
            cell = Cell.objects.get(pk=key)
            cell.value = value
            try:
                cell.save(fence=self.lease)
            except StaleToken:
                return False
            return True

        return reconnecting(fenced, time.monotonic() + RECONNECT)


def make(name: str, config: dict[str, Any]) -> Contender:
    """The contender ``name`` connected to the servers in ``config``."""
    host = config.get("redis_host") or "127.0.0.1"
    if name == "redis":
        return RedisLock(config["redis_ports"], config.get("redis_master_file", ""), host)
    if name == "redlock":
        return Redlock(config["redis_ports"], host)
    if name == "etcd":
        return EtcdLock(config["etcd_endpoints"])
    if name == "distlock":
        return Distlock()
    if name == "distlock-fenced":
        return DistlockFenced()
    raise ValueError(f"unknown contender {name!r}")
