"""Admin pages of the audit history (LockEvent): read-only, filtered by kind and age.

Registered by importing this module from :mod:`distlock.admin.locks`. The list fits a 1366 px
screen: the event's time to the second (milliseconds on hover and on the event's page),
holder and detail cut with all of their text on hover, and who broke a lock shown in the
detail column rather than a column of its own that is empty on every other row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.db.models import BooleanField, QuerySet
from django.db.models.expressions import RawSQL
from django.http import HttpRequest

from distlock.admin.display import badge, cut, precise, when
from distlock.admin.paging import CappedPaginator
from distlock.admin.search import EVENTS_HELP_TEXT, NameSearch
from distlock.backends.indexes import RARE_KINDS_SQL
from distlock.conf import conf
from distlock.constants import RARE_KINDS
from distlock.db import db_now_us
from distlock.models import LockEvent

if TYPE_CHECKING:
    _LockEventAdminBase = admin.ModelAdmin[LockEvent]
else:
    _LockEventAdminBase = admin.ModelAdmin


class KindFilter(admin.SimpleListFilter):
    """The event's kind; a rare one (a take-over, a break, a lost lease, a stale write)
    through the rare kinds' index (migration 0001).

    The rare kinds' condition is added word for word, as literal SQL: SQLite uses a
    partial index only when the query has its condition's terms, and not with bound
    parameters in their place. On every database the condition is true of the rows the
    kind selects, so it changes no answer."""

    title = "kind"
    parameter_name = "kind"
    # Django's own kind filter's parameter, which links made before this filter carry.
    _EXACT = "kind__exact"

    def __init__(
        self, request: HttpRequest, params: dict[str, Any], model: Any,
        model_admin: admin.ModelAdmin[Any],
    ) -> None:
        if self._EXACT in params:
            exact = params.pop(self._EXACT)
            params.setdefault(self.parameter_name, exact)
        super().__init__(request, params, model, model_admin)

    def expected_parameters(self) -> list[str | None]:
        return [self.parameter_name, self._EXACT]

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        return [(str(value), str(label)) for value, label in LockEvent.Kind.choices]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        kind = self.value()
        if kind is None:
            return queryset
        queryset = queryset.filter(kind=kind)
        if kind in RARE_KINDS:
            queryset = queryset.filter(RawSQL(RARE_KINDS_SQL, [], output_field=BooleanField()))
        return queryset


class AgeFilter(admin.SimpleListFilter):
    """How recent, by the database clock (the clock that stamped the events)."""

    title = "age"
    parameter_name = "age"
    _SPANS = {"hour": 3600, "day": 86400, "week": 7 * 86400}

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        return [("hour", "last hour"), ("day", "last 24 hours"), ("week", "last 7 days")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        span = self._SPANS.get(self.value() or "")
        if span is None:
            return queryset
        # The clock read once, not in the query: a per-row clock call (volatile) cannot
        # bound an index scan, and the at_us index is what keeps 10M events cheap.
        return queryset.filter(at_us__gte=db_now_us(queryset.db) - span * 1_000_000)


@admin.register(LockEvent)
class LockEventAdmin(NameSearch, _LockEventAdminBase):
    list_display = ["at", "kind_badge", "name", "token", "holder_cut", "detail_cut"]
    list_filter = [KindFilter, AgeFilter]
    # Names only, by prefix through the (name, at_us) index (NameSearch): Django's
    # icontains over name, holder, owner and who read all ten million events.
    search_fields = ["name"]
    search_help_text = EVENTS_HELP_TEXT
    newest_first = True
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    fields = ("at_precise", "kind_badge", "name", "token", "owner", "holder", "by", "detail")
    readonly_fields = fields
    list_per_page = 100
    paginator = CappedPaginator

    class Media:
        css = {"all": ("distlock/admin.css",)}  # the Locks list's stylesheet

    def get_queryset(self, request: HttpRequest) -> QuerySet[LockEvent]:
        return super().get_queryset(request).using(conf.database())

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(
        self, request: HttpRequest, obj: LockEvent | None = None
    ) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: LockEvent | None = None
    ) -> bool:
        return False

    @admin.display(description="at", ordering="at_us")
    def at(self, obj: LockEvent) -> str:
        return when(obj.at_us)

    @admin.display(description="at")
    def at_precise(self, obj: LockEvent) -> str:
        return precise(obj.at_us)

    @admin.display(description="event", ordering="kind")
    def kind_badge(self, obj: LockEvent) -> str:
        return badge(obj.kind, obj.get_kind_display())

    @admin.display(description="holder", ordering="holder")
    def holder_cut(self, obj: LockEvent) -> str:
        return cut(obj.holder)

    @admin.display(description="detail")
    def detail_cut(self, obj: LockEvent) -> str:
        text = f"by {obj.by}" + (f"; {obj.detail}" if obj.detail else "") if obj.by else obj.detail
        return cut(text, "distlock-cut distlock-detail")
