from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class PrometheusConfig(AppConfig):
    """Installing this app is the opt-in: ready() connects the metrics receivers."""

    name = "distlock.contrib.prometheus"
    label = "distlock_prometheus"
    verbose_name = "Distributed lock metrics"

    def ready(self) -> None:
        from distlock.contrib.prometheus import gauges, metrics
        from distlock.contrib.prometheus.checks import check_metrics_settings

        checks.register(check_metrics_settings)
        metrics.connect()
        gauges.register()
