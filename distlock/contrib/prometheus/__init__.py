"""Prometheus metrics for distlock's lock operations (the ``prometheus`` extra).

Opt in by adding ``"distlock.contrib.prometheus"`` to INSTALLED_APPS (after
``"distlock"``): its ready() connects the receivers (:mod:`.metrics`) to distlock's
signals. Without it nothing is connected, and the signals cost the grant path a
dictionary lookup each. It also registers the database-wide gauges (:mod:`.gauges`:
locks held, expired, sessions waiting), read by query at each scrape. Serve the numbers
with :func:`.views.metrics` (a plain Django view of prometheus_client's default
registry) or with any exporter of that registry.
The ``lock`` label is the lock name's pattern (``DISTLOCK_METRICS_NAME_PATTERN``; see
:func:`.labels.name_pattern`), never the name itself.
"""
