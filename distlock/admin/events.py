"""Admin pages of the audit history (LockEvent): read-only, filtered by kinds and age.

Registered by importing this module from :mod:`distlock.admin.locks`. The list fits a 1366 px
screen: the event's time to the second (milliseconds on hover and on the event's page),
holder and detail cut with all of their text on hover, and who broke a lock shown in the
detail column rather than a column of its own that is empty on every other row. Renewals
are left out unless asked for (:class:`KindFilter`), each name links to its lock, and
kinds are shown by their labels ("stale write refused"), never their codes.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import quote, unquote
from django.contrib.admin.views.main import SEARCH_VAR, ChangeList
from django.db.models import BooleanField, QuerySet
from django.db.models.expressions import RawSQL
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.translation import gettext

from distlock.admin.bases import LockEventModelAdmin
from distlock.admin.display import (
    badge,
    clock,
    clock_and_relative,
    cut,
    detail_html,
    detail_text,
)
from distlock.admin.paging import CappedPaginator
from distlock.admin.search import EVENTS_HELP_TEXT, EXACT, NameSearch
from distlock.backends.indexes import RARE_KINDS_SQL
from distlock.conf import conf
from distlock.constants import RARE_KINDS
from distlock.db import db_now_us
from distlock.models import Lock, LockEvent
from distlock.times import to_us

#: ``?kind=all``: every kind, renewals too.
ALL_KINDS = "all"
_RENEWED = "renewed"


class KindFilter(admin.SimpleListFilter):
    """The event's kinds, several at once (``?kind=lost&kind=broken``, ``?kind=lost,broken``
    or ``?kind__in=lost,broken``); with no kind given, every kind but renewals (an
    auto-renewing holder writes one every few seconds and fills the list), and
    ``?kind=all`` for every kind.

    Kinds that are all rare (a take-over, a break, a lost lease, a stale write) are read
    through the rare kinds' index (migration 0001): their condition is added word for
    word, as literal SQL, since SQLite uses a partial index only when the query has its
    condition's terms, and not with bound parameters in their place. On every database
    the condition is true of the rows those kinds select, so it changes no answer."""

    title = "kind"
    parameter_name = "kind"
    template = "admin/distlock/lockevent/kind_filter.html"
    # Django's own kind filter's parameter, which links made before this filter carry,
    # and the admin's usual spelling of a list of values.
    _EXACT = "kind__exact"
    _IN = "kind__in"

    def __init__(
        self, request: HttpRequest, params: dict[str, Any], model: Any,
        model_admin: admin.ModelAdmin[Any],
    ) -> None:
        given: list[str] = []
        for key in (self.parameter_name, self._EXACT, self._IN):
            for value in params.pop(key, []):
                given.extend(kind for kind in str(value).split(",") if kind)
        #: The kinds asked for, in the order of the kinds' list (unknown ones after):
        #: None for the default, every kind but renewals.
        self.kinds: list[str] | None = None
        if given:
            params[self.parameter_name] = [",".join(given)]
            known = [str(value) for value in LockEvent.Kind.values]
            wanted = set(given)
            if ALL_KINDS not in wanted:
                self.kinds = [kind for kind in known if kind in wanted] + sorted(
                    wanted - set(known))
        super().__init__(request, params, model, model_admin)

    def expected_parameters(self) -> list[str | None]:
        return [self.parameter_name, self._EXACT, self._IN]

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        return [(str(value), str(label)) for value, label in LockEvent.Kind.choices]

    def shown(self) -> set[str]:
        """The kinds the list shows."""
        if self.kinds is not None:
            return set(self.kinds)
        every = {str(value) for value in LockEvent.Kind.values}
        return every if self.value() is not None else every - {_RENEWED}

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() is None:
            return queryset.exclude(kind=_RENEWED)
        kinds = self.kinds
        if kinds is None or set(kinds) >= set(LockEvent.Kind.values):
            return queryset
        queryset = (
            queryset.filter(kind=kinds[0]) if len(kinds) == 1 else queryset.filter(kind__in=kinds)
        )
        if set(kinds) <= set(RARE_KINDS):
            queryset = queryset.filter(RawSQL(RARE_KINDS_SQL, [], output_field=BooleanField()))
        return queryset

    # Any: the stubs' choice type has no room for this template's "only" and "view".
    def choices(self, changelist: Any) -> Iterator[Any]:
        """The three common views, then each kind with a link that adds it to or takes it
        from the kinds shown and one that shows it alone (the filter's template)."""
        shown = self.shown()
        every = [str(value) for value in LockEvent.Kind.values]
        default = set(every) - {_RENEWED}
        remove = [self.parameter_name]  # a prefix: kind__exact and kind__in too

        def query(kinds: set[str] | None) -> str:
            if kinds is None or kinds == default:
                return str(changelist.get_query_string(remove=remove))
            value = ALL_KINDS if kinds == set(every) else [k for k in every if k in kinds]
            return str(changelist.get_query_string({self.parameter_name: value}, remove))

        yield {"selected": self.value() is None, "query_string": query(None),
               "display": "all but renewals", "view": True}
        yield {"selected": shown == set(every), "query_string": query(set(every)),
               "display": "all, with renewals", "view": True}
        yield {"selected": shown == {_RENEWED}, "query_string": query({_RENEWED}),
               "display": "only renewals", "view": True}
        for value, label in self.lookup_choices:
            toggled = shown ^ {value}
            yield {
                "selected": value in shown,
                "query_string": query(toggled) if toggled else query({value}),
                "only": query({value}),
                "display": label,
                "view": False,
            }


def heading(event: LockEvent) -> str:
    """ "invoice:42: stale write refused (token 4)": the event for people, with its kind's
    label where ``str()`` has the code."""
    return f"{event.name}: {event.get_kind_display()} (token {event.token})"


class _EventChangeList(ChangeList):
    """Django's list, and then, for the rows of the page only, whether each event's lock
    still has its row (one query), so the name links to the lock's page or, for a purged
    lock, to the Locks list searched for it; and the database clock, read once, which
    says which times are of its today (shown without their date)."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        names = {event.name for event in self.result_list}
        existing = set(
            Lock.objects.using(self.queryset.db).filter(name__in=names)
            .values_list("name", flat=True)
        ) if names else set()
        now_us = db_now_us(self.queryset.db) if names else 0
        for event in self.result_list:
            event.lock_exists = event.name in existing
            event.db_now_us = now_us


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
class LockEventAdmin(NameSearch, LockEventModelAdmin):
    list_display = ["at", "kind_badge", "lock_link", "token", "holder_cut", "detail_cut"]
    # The time opens the event's page; the name, the lock's (lock_link).
    list_display_links = ["at"]
    list_filter = [KindFilter, AgeFilter]
    # Names only, by prefix through the (name, at_us) index (NameSearch): Django's
    # icontains over name, holder, owner and who read all ten million events.
    search_fields = ["name"]
    search_help_text = EVENTS_HELP_TEXT
    newest_first = True
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    # The detail as people read it, its times in the site's zone (detail_shown); the
    # stored text, the record, stays as the audit wrote it.
    fields = (
        "at_precise", "kind_badge", "name", "token", "owner", "holder", "by", "detail_shown",
    )
    readonly_fields = fields
    list_per_page = 100
    paginator = CappedPaginator

    class Media:
        css = {"all": ("distlock/admin.css",)}  # the Locks list's stylesheet

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _EventChangeList

    def get_queryset(self, request: HttpRequest) -> QuerySet[LockEvent]:
        return super().get_queryset(request).using(conf.database())

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """The event's page, headed by its kind's label ("stale write refused"), not the
        code that str() of an event carries ("stale_write")."""
        obj = self.get_object(request, unquote(object_id))
        if obj is not None:
            extra_context = {"subtitle": heading(obj), **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra_context)

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> LockEvent | None:
        """The event, with the database clock read for its page's relative times."""
        obj = super().get_object(request, object_id, from_field)
        if obj is not None:
            obj.db_now_us = db_now_us(conf.database())  # type: ignore[attr-defined]
        return obj

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Django's log of the event (empty: events are never changed), headed as the
        event's page is."""
        obj = self.get_object(request, unquote(object_id))
        if obj is not None:
            extra_context = {
                "title": gettext("Change history: %s") % heading(obj),
                "heading": heading(obj), **(extra_context or {}),
            }
        return super().history_view(request, object_id, extra_context)

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
        return clock(obj.at_us, _now_us(obj))

    @admin.display(description="at")
    def at_precise(self, obj: LockEvent) -> str:
        return clock_and_relative(obj.at_us, _now_us(obj), inline=True, exact=True)

    @admin.display(description="event", ordering="kind")
    def kind_badge(self, obj: LockEvent) -> str:
        return badge(obj.kind, obj.get_kind_display())

    @admin.display(description="name", ordering="name")
    def lock_link(self, obj: LockEvent) -> str:
        """The lock's page, or the Locks list searched for the name when its row is gone
        (purged); ``lock_exists`` is set for the page's rows by :class:`_EventChangeList`."""
        site = self.admin_site.name
        if getattr(obj, "lock_exists", True):
            url = reverse(f"{site}:distlock_lock_change", args=[quote(obj.name)])
            return format_html('<a href="{}" title="the lock\'s page">{}</a>', url, obj.name)
        url = reverse(f"{site}:distlock_lock_changelist")
        return format_html(
            '<a href="{}?{}" title="no lock row (purged): the Locks list, searched">{}</a>',
            url, urlencode({SEARCH_VAR: EXACT + obj.name}), obj.name,
        )

    @admin.display(description="holder", ordering="holder")
    def holder_cut(self, obj: LockEvent) -> str:
        return cut(obj.holder)

    @admin.display(description="detail")
    def detail_cut(self, obj: LockEvent) -> str:
        # The times in it to the second in the cell, to the millisecond on hover.
        text = f"by {obj.by}" + (f"; {obj.detail}" if obj.detail else "") if obj.by else obj.detail
        now_us = _now_us(obj)
        return cut(detail_text(text, now_us), "distlock-cut distlock-detail",
                   title=detail_text(text, now_us, exact=True))

    @admin.display(description="detail")
    def detail_shown(self, obj: LockEvent) -> str:
        return detail_html(obj.detail, _now_us(obj), exact=True)


def _now_us(event: LockEvent) -> int:
    """The database clock read for the event's list or page (this server's clock for an
    event shown some other way, which only decides whether a date is written)."""
    now_us: int | None = getattr(event, "db_now_us", None)
    return now_us if now_us is not None else to_us(datetime.now(UTC))
