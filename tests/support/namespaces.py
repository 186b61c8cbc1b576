"""The tests' side of lab/netns.py: may this run make network namespaces?

One rule for every test that needs them (the partition test, the Patroni leader cut from
etcd, the lab's partition scenario): a machine that cannot skips the test, except with
``CI=true`` or ``DISTLOCK_REQUIRE_NETNS=1``, where it fails — CI must not report a skip
as a pass.
"""

from __future__ import annotations

import os

import pytest

from lab import netns
from lab.servers import Unavailable


def need_netns(test: str) -> None:
    """Skip (or, where namespaces are required, fail) ``test`` unless :func:`lab.netns.check`
    passes."""
    try:
        netns.check()
    except Unavailable as exc:
        if os.environ.get("CI") == "true" or os.environ.get("DISTLOCK_REQUIRE_NETNS") == "1":
            pytest.fail(f"CI=true / DISTLOCK_REQUIRE_NETNS=1, but this machine cannot run "
                        f"{test}: {exc}")
        pytest.skip(f"this machine cannot run {test}: {exc}")
