"""What the tests share, kept apart from the tests themselves.

* ``helpers`` — waiting on conditions with deadlines, running under a deadline, small
  conversions: imported by the test modules (shared fixtures live in ``tests/conftest.py``).
* ``processes`` and ``worker`` — real child processes (``python -m tests.support.worker``)
  and the program they run; ``fencing_workers`` and ``stress_workers`` hold their roles.
* ``celery_app`` and ``celery_workers`` — the Celery app of the Celery tests and the real
  ``celery worker`` processes that run it.
* ``pg_clusters`` — private PostgreSQL servers (one, or a primary and a streaming standby)
  for the fault and failover tests.
* ``notifications`` — counts the LISTEN/NOTIFY wake-ups a process receives (the hand-off
  tests' workers and benchmarks/waiters.py).
"""
