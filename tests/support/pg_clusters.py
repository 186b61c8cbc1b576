"""Throw-away PostgreSQL clusters for the tests: lab/pg_servers.py's, with the tests' Django.

The servers themselves (:class:`~lab.pg_servers.Server`, a primary and a streaming standby
:class:`~lab.pg_servers.Replicated`) live in the lab, which runs the same failover as a
scenario and imports nothing from tests/. Here they gain what needs tests/settings.py: the
environment of a Django process on them, migrating with it, and the lock-row and agent
queries of the fault tests (tests/test_faults.py), the failover tests
(tests/test_failover.py) and the partition test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from lab import pg_servers
from lab.pg_servers import (
    DATABASE,
    STANDBY_NAME,
    _connect,
    _server_user,
    now_us,
    pg_bin,
    stop_leftovers,
)
from lab.servers import Unavailable, free_port
from tests.support.processes import ROOT

__all__ = ["DATABASE", "STANDBY_NAME", "Replicated", "Server", "Unavailable", "_connect",
           "_server_user", "django_env", "free_port", "manage", "migrate", "now_us", "pg_bin",
           "stop_leftovers"]

_CLOCK_US = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000 AS BIGINT)"


class Server(pg_servers.Server):
    """A throw-away PostgreSQL cluster (lab/pg_servers.py) used by the tests' Django."""

    def env(self, port: int | None = None) -> dict[str, str]:
        """Environment of a Django process that uses this server (or a proxy to it)."""
        return django_env(self.url(port))

    def migrate(self) -> None:
        migrate(self.env())

    def lock_row(self, name: str, *, local: bool = False) -> dict[str, Any] | None:
        found = self.query(
            f"SELECT token, owner, acquired_us, expires_us, {_CLOCK_US} "
            "FROM distlock_lock WHERE name = %s", [name], local=local,
        )
        if not found:
            return None
        token, owner, acquired_us, expires_us, now_us = found[0]
        return {"token": token, "owner": owner, "acquired_us": acquired_us,
                "expires_us": expires_us, "now_us": now_us}

    def backend(self, label: str, **state: str) -> int | None:
        """The pid of agent ``label``'s backend, optionally only in a given wait state."""
        where = " AND ".join(f"{key} = %s" for key in state)
        found = self.query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
            + (f" AND {where}" if where else ""),
            [f"distlock-worker-agent-{label}", *state.values()],
        )
        return found[0][0] if found else None


def django_env(url: str, **databases: Any) -> dict[str, str]:
    """Environment of a Django process (tests/settings.py) on database ``distlock`` at
    ``url``; ``databases`` are DATABASES["default"] keys that replace the URL's
    (DISTLOCK_TEST_DB_SETTINGS), e.g. a HOST and PORT list."""
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DISTLOCK_TEST_BACKEND": "postgresql",
        "DISTLOCK_TEST_POSTGRES": url,
        "DISTLOCK_TEST_CHILD_DB": DATABASE,
        "DISTLOCK_TEST_DB_SETTINGS": json.dumps(databases) if databases else "",
        # Straight to the private server, even from a pass through PgBouncer.
        "DISTLOCK_TEST_PGBOUNCER": "",
        "PYTHONPATH": str(ROOT),
    }
    return env


def manage(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -m django ARGS`` in a Django process with ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "django", *args], capture_output=True, text=True,
        timeout=timeout, cwd=ROOT, env={**os.environ, **env},
    )


def migrate(env: dict[str, str]) -> None:
    done = manage(env, "migrate", "--noinput", "-v", "0")
    assert done.returncode == 0, done.stderr



class Replicated(pg_servers.Replicated):
    """A primary and a streaming standby (lab/pg_servers.py) for the tests' Django.

    The application reaches whichever is the primary the way libpq does it, through a
    host list with ``target_session_attrs=read-write`` (:meth:`env`): before the failover
    the standby refuses to be the session (it is read-only), after its promotion it is
    the one that answers.
    """

    server_class = Server
    primary: Server
    standby: Server | None

    def env(self) -> dict[str, str]:
        """A Django process's environment: both servers in one host list, the session
        read-write, so it always lands on the primary of the moment."""
        assert self.standby is not None
        return django_env(
            self.primary.url(),
            HOST="127.0.0.1,127.0.0.1",
            PORT=f"{self.primary.port},{self.standby.port}",
            OPTIONS={"target_session_attrs": "read-write", "connect_timeout": 5},
        )
