"""``scripts/compare``: run the comparison lab and print (and save) its table.

    scripts/compare                      # 20 trials a cell, every contender and scenario
    scripts/compare --quick              # one trial a cell, short rates (CI); the
                                         # partition cell for distlock-fenced only,
                                         # no pg-failover* cell (tests/test_lab.py's)
    scripts/compare --trials 5 --contenders redis,etcd --scenarios pause --html r.html

Exits 1 if a control (fault off) shows an overlap, a stale write or a lost update: then
the harness is wrong, not the contender.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lab import netns, report
from lab.django_setup import create_database, database, migrate_in_child
from lab.pg_servers import Replicated, Server
from lab.scenarios import (
    APPLIES,
    CONTENDERS,
    PG_VARIANTS,
    SCENARIOS,
    Cell,
    Servers,
    rate,
    run_cell,
)
from lab.servers import EtcdCluster, RedisNodes, Unavailable

DEFAULT_POSTGRES = "postgresql://postgres@127.0.0.1:5432/distlock_lab"


class Resource:
    """The driver's own connection to the resource rows: reset before, sum after.

    On a PostgreSQL pair (the failover scenarios) the primary changes: a connection that
    died with the old one is opened again, through the pair's host list, once.
    """

    def __init__(self, url: str) -> None:
        self.entry = database(url)
        self.conn = self.connect()

    def connect(self) -> Any:
        import psycopg

        entry = self.entry
        return psycopg.connect(host=entry["HOST"], port=entry["PORT"], user=entry["USER"],
                               password=entry["PASSWORD"] or None, dbname=entry["NAME"],
                               autocommit=True, **entry.get("OPTIONS", {}))

    def execute(self, sql: str) -> Any:
        import psycopg

        try:
            return self.conn.execute(sql)
        except psycopg.OperationalError:
            self.conn.close()
            self.conn = self.connect()
            return self.conn.execute(sql)

    def reset(self) -> None:
        self.execute(
            "INSERT INTO lab_cell (key, value, fence_token) VALUES ('a', 0, 0), ('b', 0, 0) "
            "ON CONFLICT (key) DO UPDATE SET value = 0, fence_token = 0")

    def total(self) -> int:
        row = self.execute("SELECT coalesce(sum(value), 0) FROM lab_cell").fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self.conn.close()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="one trial a cell and 1 s rates (proves the lab runs); the "
                        "pg-failover* and partition scenarios for distlock-fenced only")
    parser.add_argument("--trials", type=int, help="trials per cell (default 20; --quick 1)")
    parser.add_argument("--ttl", type=float, default=2.0,
                        help="lease length in the pause scenarios, seconds (default 2)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--rate-seconds", type=float, help="default 3 (--quick 1); 0: none")
    parser.add_argument("--postgres", default=os.environ.get("DISTLOCK_LAB_POSTGRES",
                                                             DEFAULT_POSTGRES))
    parser.add_argument("--html", type=Path, help="write the report page here")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    args.trials = args.trials or (1 if args.quick else 20)
    if args.rate_seconds is None:
        args.rate_seconds = 1.0 if args.quick else 3.0
    args.contenders = [c for c in args.contenders.split(",") if c]
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    for name in args.contenders:
        if name not in CONTENDERS:
            parser.error(f"unknown contender {name!r}; one of {', '.join(CONTENDERS)}")
    for name in args.scenarios:
        if name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}; one of {', '.join(SCENARIOS)}")
    if args.trials < 1 or args.ttl <= 0:
        parser.error("--trials and --ttl must be positive")
    return args


def migrate(url: str) -> None:
    create_database(url)
    migrate_in_child(url)


def redis_nodes(contender: str, scenario: str, holder: netns.Host | None = None
                ) -> RedisNodes | None:
    if contender not in ("redis", "redlock"):
        return None
    size = 5 if contender == "redlock" else 2 if scenario == "failover" else 1
    if scenario == "clock":
        from lab.redis_build import faketime_redis

        return RedisNodes(size, binary=faketime_redis(), faketime=True)
    if scenario == "partition" and holder is not None:
        return RedisNodes(size, also_bind=[holder.gateway])
    return RedisNodes(size)


class Network:
    """The partition scenario's machine, one per run: the holder's host (a network
    namespace, lab/netns.py) and a PostgreSQL server of its own that listens on that
    host's link too (the shared server listens on loopback only), with distlock's and the
    lab's tables: the lock of the distlock contenders and everyone's resource."""

    def __init__(self) -> None:
        self.host: netns.Host | None = None
        self.server: Server | None = None
        self.resource: Resource | None = None

    def start(self) -> None:
        """Raises lab.servers.Unavailable where namespaces or a private server cannot be
        made (the caller notes the cells as not run); what was made is left for close()."""
        netns.check()
        netns.remove_leftovers()  # only runs whose process is gone (lab/netns.py)
        self.host = netns.Host("holder")
        self.host.create()
        self.server = Server(label="labnet", listen=[self.host.gateway],
                             networks=[netns.NETWORK])
        self.server.start()
        self.server.migrate()
        self.resource = Resource(self.server.url())

    def close(self) -> None:
        if self.resource is not None:
            self.resource.close()
        if self.server is not None:
            self.server.stop()
        if self.host is not None:
            self.host.remove()


def pg_pair() -> Replicated:
    """A PostgreSQL primary with an asynchronous standby for the ``pg-failover*`` cells,
    started and migrated (the lab's tables): the lock and the resource fail over together.
    One per run, as etcd: each fault trial leaves it a pair again (replace_primary)."""
    pair = Replicated(synchronous=False)
    try:
        pair.start()
    except BaseException:
        pair.close()
        raise
    return pair


def has_cell(args: argparse.Namespace, contender: str, scenario: str) -> bool:
    """Whether this run has the cell ``contender`` × ``scenario``."""
    if scenario not in args.scenarios or contender not in APPLIES[scenario]:
        return False
    # --quick, CI's budget: the partition's distlock-fenced cell alone (the same lock as
    # unfenced distlock; the fenced cell also shows the resource's refusal), and no
    # pg-failover cell: tests/test_lab.py runs those three in the same CI run.
    if args.quick and scenario in PG_VARIANTS:
        return False
    return not (args.quick and scenario == "partition" and contender != "distlock-fenced")


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    migrate(args.postgres)
    resource = Resource(args.postgres)
    cells: list[Cell] = []
    rates: dict[str, float] = {}
    notes: list[str] = []
    etcd: EtcdCluster | None = None
    pair: Replicated | None = None  # the PostgreSQL failover scenarios' (one per run)
    pair_resource: Resource | None = None
    network: Network | None = None  # the partition scenario's (one per run)
    try:
        if any(has_cell(args, contender, "partition") for contender in args.contenders):
            network = Network()
            try:
                network.start()
            except Unavailable as why:
                notes.append(f"partition not run: {why}")
                network.close()
                network = None
        if "etcd" in args.contenders:
            # In the partition scenario A reaches etcd over its link's root end too.
            etcd = EtcdCluster(also_listen=[network.host.gateway]
                               if network is not None and network.host is not None else [])
            etcd.start()
        for contender in args.contenders:
            for scenario in args.scenarios:
                if not has_cell(args, contender, scenario):
                    continue
                on_network = scenario == "partition"
                if on_network and network is None:
                    continue  # noted above
                holder = network.host if network is not None and on_network else None
                try:
                    nodes = redis_nodes(contender, scenario, holder)
                    if nodes:
                        nodes.start()
                    if scenario in PG_VARIANTS and pair is None:
                        pair = pg_pair()
                        pair_resource = Resource(pair.url())
                except Unavailable as why:
                    notes.append(f"{contender} × {scenario} not run: {why}")
                    continue
                try:
                    began = time.monotonic()
                    on_pair = scenario in PG_VARIANTS
                    follow = PG_VARIANTS.get(scenario, (True, False))[0]
                    servers = Servers(nodes, etcd, pair if on_pair else None, scenario, follow,
                                      holder)
                    postgres: str = args.postgres
                    on: Resource | None = resource
                    if on_pair:
                        on = pair_resource
                    elif on_network and network is not None and network.server is not None:
                        postgres, on = network.server.url(), network.resource
                    cells.extend(run_cell(contender, scenario, servers, postgres,
                                          args.trials, args.ttl, on))
                    print(f"  {contender} × {scenario}: {args.trials} trial(s) with the fault"
                          f" off and on, {time.monotonic() - began:.1f} s", file=sys.stderr,
                          flush=True)
                finally:
                    if nodes:
                        nodes.stop()
            if args.rate_seconds > 0:
                nodes = redis_nodes(contender, "rate")
                if nodes:
                    nodes.start()
                try:
                    rates[contender] = rate(contender, Servers(nodes, etcd), args.postgres,
                                            args.rate_seconds, args.ttl)
                finally:
                    if nodes:
                        nodes.stop()
    finally:
        if etcd is not None:
            etcd.stop()
        if pair_resource is not None:
            pair_resource.close()
        if pair is not None:
            pair.close()
        if network is not None:
            network.close()
    return {
        "command": "scripts/compare " + " ".join(sys.argv[1:]),
        "trials": args.trials, "ttl": args.ttl, "seconds": round(time.monotonic() - started, 1),
        "cells": [asdict(cell) for cell in cells], "rates": rates, "notes": notes,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    results = run(args)
    print(report.text(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.html:
        args.html.write_text(report.html(results))
    broken = report.broken_controls(results)
    for line in broken:
        print(f"CONTROL FAILED (a harness error, not a result): {line}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
