"""Paging of the admin lists over tables that grow with a site's business.

Django's changelist counts every row of the list it pages, on every view. A lock table
of a million rows or an audit history of ten million makes that count the dearest part
of the page (a whole-table scan, about a second for 10M events; benchmarks/rows.py).
Counting at most ``CAP + 1`` rows answers what the page needs — how many pages, up to a
point — and the list then says "more than 10000" (``admin/distlock/pagination.html``).
Sorting is bounded the same way: the Locks list sorts by other columns than the name only
where the owned rows' index reads the rows (``SORTED_STATES``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest
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
        # back through every event of a name prefix to count them in time order). Only
        # the key: the Locks list's state and clock annotations, computed for each of
        # the CAP + 1 rows, were most of its count (MariaDB, 1M rows: 36 ms).
        return int(rows.order_by().values("pk")[: self.CAP + 1].count())


# The Locks list's columns other than the name sort only the held or the expired locks:
# those are read through the owned rows' index (migration 0001), so a sort orders what
# is held, not the table. Over every row, or the free ones, each would be a sort of the
# whole table (462 ms at a million rows on PostgreSQL; docs/performance.md), and an index
# per column would cost every grant: the name, the primary key, is the one order there.
SORTED_STATES = ("held", "expired")


def sortable_columns(request: HttpRequest, list_display: Sequence[Any], always: str) -> list[Any]:
    """The columns the Locks list offers to sort by for this request's state filter."""
    if request.GET.get("state") in SORTED_STATES:
        return list(list_display)
    return [always]


class SortedWhereBounded(ChangeList):
    """A ChangeList that ignores a requested order (``?o=``) of a column it does not
    offer to sort by: Django would sort by it all the same."""

    def get_ordering(self, request: HttpRequest, queryset: QuerySet[Any]) -> list[Any]:
        order = self.params.get(ORDER_VAR)
        if order and self.sortable_by is not None:
            kept = [part for part in str(order).split(".") if self._offered(part)]
            if kept:
                self.params[ORDER_VAR] = ".".join(kept)
            else:
                del self.params[ORDER_VAR]
        return list(super().get_ordering(request, queryset))

    def _offered(self, part: str) -> bool:
        index = part.rpartition("-")[2]
        if not index.isdigit() or int(index) >= len(self.list_display):
            return False
        return self.list_display[int(index)] in (self.sortable_by or ())
