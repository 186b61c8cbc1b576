"""A lab client: one process that runs one contender, driven over stdin/stdout.

    python -m lab.worker CONTENDER CONFIG_JSON     # one JSON command a line, one answer a line
    python -m lab.worker --migrate CONFIG_JSON     # the lab database's tables, then exit
    python -m lab.worker --failover CONFIG_JSON    # manage.py distlock_failover there

Every answer carries ``t0``/``t1``: ``time.monotonic()`` at the start and the end of the
operation. On Linux that clock is the machine's, one for all processes, so the driver can
lay both clients' operations on one history. A command is answered only once it is done;
the driver's SIGSTOP between two commands is a pause of the whole process (its threads too).
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from typing import Any

from lab import django_setup


def serve(name: str, config: dict[str, Any]) -> None:
    from lab import contenders

    contender = contenders.make(name, config)
    answer({"ready": True, "fenced": contender.fenced})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            return
        t0 = time.monotonic()
        try:
            result = run(contender, op, command)
        except Exception as error:  # the driver reports it with the trial
            answer({"op": op, "error": f"{type(error).__name__}: {error}",
                    "trace": traceback.format_exc(), "t0": t0, "t1": time.monotonic()})
            continue
        answer({"op": op, "result": result, "t0": t0, "t1": time.monotonic()})


def run(contender: Any, op: str, command: dict[str, Any]) -> Any:
    from lab.contenders import read

    if op == "acquire":
        return contender.acquire(command["ttl"], command["timeout"])
    if op == "release":
        return contender.release()
    if op == "read":
        return read(command["key"])
    if op == "write":
        return contender.write(command["key"], command["value"])
    if op == "rate":
        return rate(contender, command["seconds"], command["ttl"])
    if op == "reach":
        return reach(command["addresses"], command["timeout"])
    raise ValueError(f"unknown op {op!r}")


def reach(addresses: list[list[Any]], timeout: float) -> list[str]:
    """The ``[host, port]`` addresses a TCP connection from here reaches within
    ``timeout`` seconds, all tried at once (the partition scenario's proof that its cut
    holds, and that its control's link carries A's traffic)."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    def one(address: list[Any]) -> str | None:
        try:
            with socket.create_connection((address[0], int(address[1])), timeout=timeout):
                return f"{address[0]}:{address[1]}"
        except OSError:
            return None

    with ThreadPoolExecutor(max_workers=len(addresses) or 1) as pool:
        return [found for found in pool.map(one, addresses) if found]


def rate(contender: Any, seconds: float, ttl: float) -> float:
    """Uncontended acquire + release cycles per second, for ``seconds``."""
    cycles = 0
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if contender.acquire(ttl, 0) is None:
            raise RuntimeError("an uncontended acquire was refused")
        contender.release()
        cycles += 1
    return cycles / (time.monotonic() - start)


def answer(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    name, config = argv[0], json.loads(argv[1])
    # distlock warns of each lost lock; in the lab that is the point, counted in the table.
    logging.getLogger("distlock").setLevel(logging.ERROR)
    django_setup.setup(config["postgres"], follow=config.get("follow", True))
    if name == "--migrate":
        django_setup.migrate()
        return
    if name == "--failover":
        from django.core.management import call_command

        call_command("distlock_failover")  # the operator's step (docs/deployment.md)
        return
    serve(name, config)


if __name__ == "__main__":
    main(sys.argv[1:])
