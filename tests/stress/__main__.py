"""The load run: ``python -m tests.stress --processes 16 --seconds 60 --names 100``.

Creates a throw-away test database on the backend named by DISTLOCK_TEST_BACKEND (sqlite
by default; postgresql, mariadb), runs the harness with the nemesis and the checker, prints
the summary and the figures, drops the database, and exits 1 if the checker found a
violation (the histories and table dumps are then kept under artifacts/).
"""

from __future__ import annotations

import argparse
import os
import random
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stress", description=__doc__)
    parser.add_argument("--processes", type=int, default=6, help="worker processes")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the fault phase")
    parser.add_argument("--names", type=int, default=2, help="lock names (one resource each)")
    parser.add_argument("--ttl", type=float, default=1.0, help="lease length in seconds")
    parser.add_argument("--seed", type=int, default=None, help="replay a run (printed)")
    parser.add_argument("--no-nemesis", action="store_true", help="no faults: throughput only")
    parser.add_argument("--fencing-off", action="store_true", help="self-test: must fail")
    parser.add_argument("--weak-clock", action="store_true", help="self-test: must fail")
    parser.add_argument("--keep", choices=["failure", "always", "never"], default="failure")
    options = parser.parse_args(argv)

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    os.environ.setdefault("DISTLOCK_TEST_DB_SUFFIX", "_stress")
    import django

    django.setup()
    from django.test.utils import setup_databases, teardown_databases

    from tests.stress.checker import Volume
    from tests.stress.harness import Profile, run

    seed = options.seed if options.seed is not None else random.randrange(2**31)
    minutes = options.seconds / 60
    profile = Profile(
        workers=options.processes, locks=options.names, ttl=options.ttl,
        fault_seconds=options.seconds, fencing=not options.fencing_off,
        weak_clock=options.weak_clock,
        volume=Volume(grants=int(200 * minutes), writes=int(120 * minutes),
                      stale_refused=int(10 * minutes)),
    )
    if options.no_nemesis:
        profile.nemesis_weights = (0, 0, 0, 0, 1)
    print(f"distlock stress: seed={seed} (replay with --seed {seed})", flush=True)
    old = setup_databases(verbosity=0, interactive=False)
    try:
        outcome = run(profile, seed, keep_on=options.keep)
    finally:
        teardown_databases(old, verbosity=0)
    report = outcome.report
    print(outcome.line())
    print(outcome.verdict())
    print(
        f"figures: {report.grants / options.seconds:.1f} grants/s, "
        f"{report.writes / options.seconds:.1f} accepted writes/s, "
        f"{report.stale_refused} stale writes refused, "
        f"{len(report.violations)} violations"
    )
    if not report.ok:
        print(report.describe())
    if outcome.artifacts:
        print(f"histories and table dumps kept in {outcome.artifacts}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
