"""rows.py's "purge beside acquire": what a purge of a large idle table does to the
acquires running beside it, and how much of it is only the CPU the purge takes.

A round, on the large table (filled again first, since a purge empties it):

1. idle: ``cycles`` re-acquires of existing names, nothing else running;
2. purge: a child process runs ``purge_batch`` over the whole table, batch by batch as
   ``purge_locks`` does (each batch's transaction timed), while this process keeps
   re-acquiring; the child's CPU time and, on PostgreSQL, its server backend's, are read
   from the operating system;
3. burn: a child that only burns CPU (no database) for as long as the purge took, at the
   share of a core the purge used (client plus server), while this process re-acquires.

If "burn" slows acquires as much as "purge" does, the database work of the purge is not
what costs them: a 2-core machine running a second busy process is. Every figure is the
median over rounds.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import percentile

_TICKS = os.sysconf("SC_CLK_TCK")


def _process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of process ``pid`` so far; None if unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _server_pid(db_alias: str) -> int | None:
    from django.db import connections

    connection = connections[db_alias]
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def _purge_child(db_alias: str, batch: int, rest: float | None, events_days: int | None,
                 queue: Any) -> None:
    """purge_locks' batches (distlock.core.purge.purge_batches), or with ``events_days`` audit
    retention's of events older than that many days (distlock.ops.audit.event_batches), each
    batch's transaction timed."""
    from django.db import connections

    from distlock.core.purge import purge_batches
    from distlock.db import db_now_us
    from distlock.ops.audit import event_batches

    if events_days is None:
        batches_run = purge_batches(db_alias, 3600 * 10**6, batch, rest)
    else:
        cutoff = db_now_us(db_alias) - events_days * 86400 * 10**6
        batches_run = event_batches(db_alias, cutoff, batch, rest)
    server = _server_pid(db_alias)
    server_before = _process_cpu(server) if server else None
    own_before = sum(os.times()[:2])
    batches: list[float] = []
    deleted = 0
    started = time.perf_counter()
    for count, took in batches_run:
        batches.append(took * 1000)
        deleted += count
    seconds = time.perf_counter() - started
    cpu = sum(os.times()[:2]) - own_before
    server_after = _process_cpu(server) if server else None
    if server_before is not None and server_after is not None:
        cpu += server_after - server_before
    connections.close_all()
    queue.put({"deleted": deleted, "seconds": seconds, "batches": len(batches),
               "batch_p50_ms": percentile(batches, 0.5), "batch_max_ms": max(batches),
               "cpu_share": cpu / seconds})


def _burn_child(seconds: float, share: float, queue: Any) -> None:
    """Busy for ``share`` of every 10 ms for ``seconds``: CPU use and nothing else."""
    slice_s = 0.01
    end = time.perf_counter() + seconds
    while (now := time.perf_counter()) < end:
        busy_until = now + slice_s * share
        while time.perf_counter() < busy_until:
            pass
        rest = slice_s * (1 - share)
        if rest > 0:
            time.sleep(rest)  # the idle part of the duty cycle, not a wait for a condition
    queue.put({"seconds": seconds})


# rows.py's measure(): latencies in µs by operation, of ``n`` cycles (re-acquires of
# existing names) and ``n // 10`` first uses of new names (which read the token floor a
# purge batch holds locked until it commits).
Cycles = Callable[[int], dict[str, list[float]]]
OPS = ("re-acquire", "first use")


def _beside(cycles: Cycles, child: Any, queue: Any) -> tuple[dict[str, list[float]],
                                                               dict[str, Any]]:
    """Latencies (µs) by operation while ``child`` runs, and the child's report."""
    got: dict[str, list[float]] = {op: [] for op in OPS}
    while child.is_alive() and queue.empty():
        for op, took in cycles(100).items():
            if op in got:
                got[op] += took
    report = queue.get(timeout=900)
    child.join(timeout=60)
    return got, report


def one_round(
    db_alias: str, cycles: Cycles, idle_cycles: int, batch: int, rest: float | None,
    events_days: int | None = None,
) -> dict[str, Any]:
    """Idle, beside a purge, beside a CPU burner of the purge's CPU share (module doc)."""
    from django.db import connections

    idle = cycles(idle_cycles)
    load = os.getloadavg()[0]
    connections.close_all()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_purge_child, args=(db_alias, batch, rest, events_days, queue))
    child.start()
    purge, report = _beside(cycles, child, queue)
    share = min(1.0, report["cpu_share"])
    child = context.Process(target=_burn_child,
                            args=(min(report["seconds"], 15.0), share, queue))
    child.start()
    burn, _ = _beside(cycles, child, queue)
    got = {**report, "load": load}
    for op, key in zip(OPS, ("", "first_"), strict=True):
        idle_p99 = percentile(idle[op], 0.99)
        got.update({
            f"{key}idle_p50": percentile(idle[op], 0.5), f"{key}idle_p99": idle_p99,
            f"{key}purge_p99": percentile(purge[op], 0.99),
            f"{key}burn_p99": percentile(burn[op], 0.99),
            f"{key}purge_ratio": percentile(purge[op], 0.99) / idle_p99,
            f"{key}burn_ratio": percentile(burn[op], 0.99) / idle_p99,
        })
    return got


COLUMNS = (("idle p50 µs", "idle_p50", "{:,.0f}"), ("idle p99 µs", "idle_p99", "{:,.0f}"),
           ("beside purge p99 µs", "purge_p99", "{:,.0f}"), ("ratio", "purge_ratio", "{:.2f}"),
           ("beside CPU burner p99 µs", "burn_p99", "{:,.0f}"),
           ("burner ratio", "burn_ratio", "{:.2f}"),
           ("first use: idle p99 µs", "first_idle_p99", "{:,.0f}"),
           ("beside purge p99 µs", "first_purge_p99", "{:,.0f}"),
           ("ratio", "first_purge_ratio", "{:.2f}"),
           ("beside burner p99 µs", "first_burn_p99", "{:,.0f}"),
           ("purge CPU share", "cpu_share", "{:.2f}"),
           ("batch p50 ms", "batch_p50_ms", "{:.1f}"), ("batch max ms", "batch_max_ms",
                                                         "{:.1f}"),
           ("purge s", "seconds", "{:.1f}"), ("load avg", "load", "{:.2f}"))


def table_row(
    backend: str, batch: int, rest: float | None, rounds: list[dict[str, Any]]
) -> str:
    """One Markdown row: the median over ``rounds`` of each column."""
    cells = [fmt.format(statistics.median(r[key] for r in rounds)) for _, key, fmt in COLUMNS]
    shown = "default" if rest is None else f"{rest:g}"
    return f"| {backend} | {batch:,} | {shown} | {len(rounds)} | {' | '.join(cells)} |"


def table_head() -> str:
    names = " | ".join(name for name, _, _ in COLUMNS)
    return (f"| backend | batch | rest | rounds | {names} |\n"
            f"|---|---:|---:|---:|{'---:|' * len(COLUMNS)}")
