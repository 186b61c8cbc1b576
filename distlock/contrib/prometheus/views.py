"""``metrics``: the Prometheus text exposition of this process, as a plain Django view."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """prometheus_client's default registry (distlock's metrics and any others there).

    It says how busy your locks are and what they are named like: serve it where only
    your Prometheus can reach it (an internal port, a network policy, or a check in your
    own view that wraps this one).
    """
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)
