"""Paging of the admin lists over tables that grow with a site's business.

Django's changelist counts every row of the list it pages, on every view. A lock table
of a million rows or an audit history of ten million makes that count the dearest part
of the page (a whole-table scan, about a second for 10M events; benchmarks/rows.py).
Counting at most ``CAP + 1`` rows answers what the page needs — how many pages, up to a
point — and the list then says "more than 10000" (``admin/distlock/pagination.html``).
"""

from __future__ import annotations

from typing import Any

from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.utils.functional import cached_property


class CappedPaginator(Paginator):  # type: ignore[type-arg]
    """A Paginator whose count stops at ``CAP + 1``: pages beyond the CAP-th row are not
    offered; filters and search reach older or rarer rows."""

    CAP = 10_000

    @cached_property
    def count(self) -> int:
        rows: QuerySet[Any] = self.object_list  # type: ignore[assignment]
        # Without the list's order: any CAP + 1 rows count the same, and the database
        # may read them through whichever index finds them first (SQLite walked at_us
        # back through every event of a name prefix to count them in time order).
        return int(rows.order_by()[: self.CAP + 1].count())
