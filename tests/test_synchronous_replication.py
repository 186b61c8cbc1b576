"""A commit whose wait for the synchronous standby was cancelled is not reported as done.

With synchronous replication a COMMIT waits until the standby has it. If the wait is
cancelled (``pg_cancel_backend``, ``statement_timeout``) or the backend terminated
(``pg_terminate_backend``), PostgreSQL keeps the commit and answers with success plus a
WARNING: a failover to the standby may lose it. distlock raises NotReplicated for a grant,
renewal or fenced write committed that way (distlock/backends/pg_syncrep.py).

Each test uses a private primary with a synchronous standby (tests/support/pg_clusters.py,
one pair for the module) and an agent process (tests/support/stress_workers.py) on it.
The standby stops receiving WAL (``cut_replication``), so the agent's commit waits in
``SyncRep``; the test then cancels or terminates that backend, reads what the primary
committed, and lets the standby stream again. Runs in the PostgreSQL pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support.helpers import wait_until
from tests.support.pg_clusters import Replicated
from tests.support.processes import Child, Children

pytestmark = [
    pytest.mark.processes,
    pytest.mark.no_pooler("runs its own PostgreSQL servers: no pooler is in the way"),
]

if os.environ.get("DISTLOCK_TEST_BACKEND") != "postgresql":
    pytest.skip("synchronous replication is PostgreSQL's: the PostgreSQL pass runs these",
                allow_module_level=True)

NAMES = ("syncrep-renew", "syncrep-grant", "syncrep-release")


@pytest.fixture(scope="module")
def pair() -> Iterator[Replicated]:
    servers = Replicated(synchronous=True)
    try:
        servers.start()
        for name in NAMES:
            servers.primary.query(
                "INSERT INTO stressapp_resource (name, value, version, fence_token) "
                "VALUES (%s, 0, 0, 0)", [name],
            )
        yield servers
    finally:
        servers.close()


@pytest.fixture
def children() -> Iterator[Children]:
    group = Children()
    try:
        yield group
    finally:
        group.close()


@pytest.fixture
def cut(pair: Replicated) -> Iterator[Replicated]:
    """The standby stops receiving during the test (commits wait) and streams after it."""
    yield pair
    pair.resume_replication()


def agent(children: Children, pair: Replicated, label: str, name: str) -> Child:
    child = children.start("tests.support.stress_workers:agent", label, name, env=pair.env())
    child.expect("ready", timeout=60)
    return child


def waiting_for_the_standby(pair: Replicated, label: str) -> int:
    """The pid of agent ``label``'s backend once its commit waits for the standby."""
    found: list[int] = []

    def waits() -> bool:
        pid = pair.primary.backend(label, wait_event="SyncRep")
        if pid is not None:
            found.append(pid)
        return pid is not None

    wait_until(waits, 30, f"agent {label}'s commit to wait for the standby", every=0.02)
    return found[0]


def test_a_renewal_and_a_fenced_write_whose_wait_was_cancelled_raise(children, cut):
    pair = cut
    holder = agent(children, pair, "R", "syncrep-renew")
    holder.send("acquire", ttl=60, timeout=10)
    held = holder.expect("acquired")
    pair.cut_replication()
    # The renewal commits on the primary, waits for the standby, and is cancelled.
    holder.send("renew")
    pid = waiting_for_the_standby(pair, "R")
    pair.primary.query("SELECT pg_cancel_backend(%s)", [pid])
    refused = holder.expect("not_replicated")
    assert refused["operation"] == "renewal of lock 'syncrep-renew'"
    assert "canceling wait for synchronous replication" in refused["error"]
    row = pair.primary.lock_row("syncrep-renew")
    assert row is not None and (row["owner"], row["token"]) == (held["owner"], held["token"])
    assert row["expires_us"] > held["expires_us"]  # committed on the primary all the same
    # A fenced write committed on its own: the same.
    holder.send("write_alone")
    pid = waiting_for_the_standby(pair, "R")
    pair.primary.query("SELECT pg_cancel_backend(%s)", [pid])
    refused = holder.expect("not_replicated")
    assert refused["operation"].startswith("fenced write to ")
    assert pair.primary.query(
        "SELECT value, fence_token FROM stressapp_resource WHERE name = 'syncrep-renew'"
    ) == [(1, held["token"])]


def test_a_grant_whose_backend_was_terminated_while_waiting_raises(children, cut):
    pair = cut
    grantee = agent(children, pair, "G", "syncrep-grant")
    pair.cut_replication()
    grantee.send("acquire", ttl=60, timeout=10)
    pid = waiting_for_the_standby(pair, "G")
    pair.primary.query("SELECT pg_terminate_backend(%s)", [pid])
    refused = grantee.expect("not_replicated")
    assert refused["operation"] == "grant of lock 'syncrep-grant'"
    assert "synchronous replication" in refused["error"]
    # Committed on the primary: the row names an owner nobody was told about, until the
    # ttl ends (possibly held, as NotReplicated documents).
    row = pair.primary.lock_row("syncrep-grant")
    assert row is not None and row["owner"] != ""
    assert row["expires_us"] - row["now_us"] > 50_000_000


def test_a_release_does_not_wait_for_the_standby(children, cut):
    pair = cut
    holder = agent(children, pair, "L", "syncrep-release")
    holder.send("acquire", ttl=60, timeout=10)
    holder.expect("acquired")
    pair.cut_replication()
    holder.send("release")
    assert holder.expect("released", timeout=30)["held"] is True
    row = pair.primary.lock_row("syncrep-release")
    assert row is not None and row["owner"] == ""
