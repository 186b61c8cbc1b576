from importlib.util import find_spec

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("bank/", include("demo_project.bank.urls")),
]
# As settings.py installs distlock.contrib.prometheus: when the prometheus extra is there.
if find_spec("prometheus_client"):
    # Prometheus scrapes the lock metrics here (docs/operations.md, "Metrics").
    from distlock.contrib.prometheus.views import metrics

    urlpatterns.append(path("metrics", metrics, name="metrics"))
