from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import include, path

# The seam matrix (tests/test_seams.py) runs a cell's body inside this view, so that it
# runs under ATOMIC_REQUESTS the way a site's own view would.
seam_view_body: Callable[[], Any] | None = None
seam_view_result: Any = None


def seam_view(request: HttpRequest) -> HttpResponse:
    global seam_view_result
    assert seam_view_body is not None, "no seam cell is running"
    seam_view_result = seam_view_body()
    return HttpResponse("done")


urlpatterns = [
    path("admin/", admin.site.urls),
    path("seam/", seam_view),
    path("bank/", include("demo_project.bank.urls")),
]
