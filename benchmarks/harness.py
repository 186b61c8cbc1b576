"""One measurement: fork N workers, start them together at a barrier, count cycles.

A cycle is one try to acquire and, when granted, the release. Workers run tries back to
back with no pause (the anchors' method), so a busy lock costs a refused try. Each worker
reports its own counts and latencies; the parent sums and takes percentiles.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import random
import statistics
import threading
import traceback
from dataclasses import dataclass
from time import perf_counter, process_time
from typing import Any

from benchmarks.contenders import Contender

# Scenario -> how a worker picks the name of its next try.
SCENARIOS = ("solo", "own", "contend")


@dataclass
class Result:
    """What one measurement saw, summed over its workers."""

    rate: float  # granted cycles per second, all workers together
    tries: float  # tries per second (granted or refused)
    acquire_p50_us: float  # one granted acquire call
    acquire_p99_us: float
    wait_p50_us: float | None  # first refused try -> grant (only when something waited)
    wait_p99_us: float | None
    jain: float  # fairness of grants over workers: 1.0 = equal shares
    cpu_us: float  # client CPU (user + system) per granted cycle, mean over workers


def reap(processes: list[Any], timeout: float) -> None:
    """Join each of ``processes``; kill (and join) one still running after ``timeout`` s,
    so a stuck worker ends the measurement instead of hanging it."""
    for process in processes:
        process.join(timeout=timeout)
        if process.is_alive():
            process.kill()
            process.join()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def jain(values: list[float]) -> float:
    square = sum(v * v for v in values)
    return 1.0 if square == 0 else sum(values) ** 2 / (len(values) * square)


def _pick_name(scenario: str, index: int, names: list[str], rng: random.Random) -> str:
    if scenario == "solo":
        return rng.choice(names)
    if scenario == "own":
        return f"own:{index}"
    return "contended"


def _loop(contender: Contender, scenario: str, index: int, names: list[str],
          rng: random.Random, seconds: float) -> dict[str, Any]:
    cycles = tries = 0
    latencies: list[float] = []
    waits: list[float] = []
    refused_since: float | None = None
    cpu = process_time()
    start = perf_counter()
    end = start + seconds
    now = start
    while now < end:
        name = _pick_name(scenario, index, names, rng)
        began = perf_counter()
        handle = contender.try_acquire(name)
        now = perf_counter()
        tries += 1
        if handle is None:
            if refused_since is None:
                refused_since = began
            continue
        latencies.append(now - began)
        if contender.blocks:
            waits.append(now - began)
        elif refused_since is not None:
            waits.append(now - refused_since)
            refused_since = None
        contender.release(handle)
        cycles += 1
        now = perf_counter()
    return {
        "cycles": cycles, "tries": tries, "elapsed": now - start,
        "cpu": process_time() - cpu,
        "latencies": latencies, "waits": waits,
    }


def _worker(contender: Contender, scenario: str, index: int, names: list[str],
            warmup: float, seconds: float, barrier: Any, queue: Any) -> None:
    try:
        contender.connect()
        rng = random.Random(index)
        _loop(contender, scenario, index, names, rng, warmup)
        barrier.wait(timeout=120)
        queue.put((index, _loop(contender, scenario, index, names, rng, seconds)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        barrier.abort()
        queue.put((index, {"error": traceback.format_exc()}))
    finally:
        contender.close()


class WorkerFailed(RuntimeError):
    pass


def measure(contender: Contender, scenario: str, procs: int, seconds: float,
            warmup: float, names: list[str]) -> Result:
    """Run ``procs`` forked workers of ``contender`` on ``scenario``; return the totals."""
    from django.db import connections

    # Forked children must not share the parent's sockets.
    connections.close_all()
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(procs + 1)
    queue = context.Queue()
    workers = [
        context.Process(
            target=_worker,
            args=(contender, scenario, i, names, warmup, seconds, barrier, queue),
        )
        for i in range(procs)
    ]
    for worker in workers:
        worker.start()
    reports: dict[int, dict[str, Any]] = {}
    try:
        # A worker that failed aborts the barrier; its report says why.
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=120)
        while len(reports) < procs:
            index, report = queue.get(timeout=seconds + warmup + 120)
            reports[index] = report
    finally:
        reap(workers, 30)
    errors = [r["error"] for r in reports.values() if "error" in r]
    if errors:
        raise WorkerFailed(f"{contender.label} / {scenario}:\n{errors[0]}")
    latencies = [x for r in reports.values() for x in r["latencies"]]
    waits = [x for r in reports.values() for x in r["waits"]]
    if not latencies:
        raise WorkerFailed(f"{contender.label} / {scenario}: no grant at all")
    return Result(
        rate=sum(r["cycles"] / r["elapsed"] for r in reports.values()),
        tries=sum(r["tries"] / r["elapsed"] for r in reports.values()),
        acquire_p50_us=statistics.median(latencies) * 1e6,
        acquire_p99_us=percentile(latencies, 0.99) * 1e6,
        wait_p50_us=statistics.median(waits) * 1e6 if waits else None,
        wait_p99_us=percentile(waits, 0.99) * 1e6 if waits else None,
        jain=jain([float(r["cycles"]) for r in reports.values()]),
        cpu_us=statistics.mean(r["cpu"] / max(1, r["cycles"]) for r in reports.values()) * 1e6,
    )
