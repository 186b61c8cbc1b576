"""The lock table's admin: the read-only list (state and held-by filters, name search,
bounded paging) and the URLs of the overview and timeline pages.

Its parts live beside it: the lock's own page's fields in :mod:`~distlock.admin.lock_page`,
the guarded "break" action and its confirmation in :mod:`~distlock.admin.breaking`, the
filters in :mod:`~distlock.admin.filters`; the audit history's pages are in
:mod:`distlock.admin.events`, the overview's view in :mod:`distlock.admin.views.overview`.

Nothing here writes lock rows. Token, owner and expiry are never editable: an edited token
would defeat fencing, and deleting a row could let a name start again below a token
already handed out.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.translation import gettext

from distlock.admin.breaking import LockBreaking
from distlock.admin.display import (
    badge,
    clock_and_relative,
    freed,
    holder_text,
    mark_freed,
    short_owner,
)
from distlock.admin.filters import HeldByFilter, LeaderFilter, StateFilter, held_by_term
from distlock.admin.lock_page import LockPage
from distlock.admin.paging import CappedPaginator, SortedWhereBounded, sortable_columns
from distlock.admin.search import HELP_TEXT, NameSearch
from distlock.admin.views.overview import fragment as overview_fragment
from distlock.admin.views.overview import page as overview_page
from distlock.admin.views.timeline import timeline_url
from distlock.conf import conf
from distlock.constants import LEADER_MARK
from distlock.core.status import LockWithState, relative, with_state
from distlock.models import Lock

# The lists' widths, truncation and two-line time cells (the same for both lists).
_MEDIA_CSS = {"all": ("distlock/admin.css",)}


class _LockChangeList(SortedWhereBounded):
    """Django's list, and then, for the rows of the page only, how each free lock was
    freed (released or broken), from the audit: the lock row cannot tell."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        mark_freed(self.result_list, self.queryset.db)


@admin.register(Lock)
class LockAdmin(NameSearch, LockPage, LockBreaking):
    list_display = [
        "name", "state_badge", "holder_cut", "token", "acquired", "expires", "renewed",
    ]
    list_filter = [StateFilter, HeldByFilter, LeaderFilter]
    # The box searches names only, by prefix through the primary key (NameSearch: one
    # range of the index, where Django's search would scan the table).
    search_fields = ["name"]
    search_help_text = HELP_TEXT
    ordering = ["name"]
    # A filtered or searched list counts its own rows only: Django's default also counts
    # the whole table for "(n total)", a second full scan on a large lock table. Facet
    # counts would scan it once per filter choice (benchmarks/rows.py).
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = CappedPaginator
    actions = ["break_selected"]
    # Tuples: django-stubs types fields and readonly_fields differently, and only a tuple
    # (immutable, so covariant) suits both.
    fields = (
        "name", "state_badge", "holder", "owner", "token", "held_for", "acquired_at",
        "renewed_at", "expires_at", "lease_policies", "waiters", "last_hour", "broken_by",
        "history",
    )
    # A free lock has no expiry: its page says how and when it was freed instead.
    readonly_fields = (*fields, "freed_at", "leader_term")
    change_form_template = "admin/distlock/lock/change_form.html"
    change_list_template = "admin/distlock/lock/change_list.html"

    class Media:
        css = _MEDIA_CSS

    # --- read-only table -------------------------------------------------------------

    def get_fields(self, request: HttpRequest, obj: Lock | None = None) -> Any:
        if obj is not None and obj.is_free:
            return tuple("freed_at" if f == "expires_at" else f for f in self.fields)
        if obj is not None and LEADER_MARK in obj.holder:
            # An election's lock: its term and since when, next to the token.
            index = self.fields.index("token") + 1
            return (*self.fields[:index], "leader_term", *self.fields[index:])
        return self.fields

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _LockChangeList

    def get_sortable_by(self, request: HttpRequest) -> list[Any]:
        return sortable_columns(request, self.list_display, "name")  # admin_paging.py

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> Lock | None:
        obj = super().get_object(request, object_id, from_field)
        if obj is not None:
            mark_freed([obj], conf.database())
        return obj

    def get_urls(self) -> list[URLPattern]:
        """The overview page and its refreshed fragment, and the timeline of several locks
        (distlock/admin/views/timeline.py), before Django's own URLs (whose
        ``<path:object_id>/`` would take "overview/" for a lock name). A lock's own page
        shows its picture through templates/admin/distlock/lock/change_form.html."""
        view = self.admin_site.admin_view
        return [
            path("overview/", view(overview_page(self)), name="distlock_overview"),
            path("overview/fragment/", view(overview_fragment(self)),
                 name="distlock_overview_fragment"),
            timeline_url(self),
            *super().get_urls(),
        ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[LockWithState]:
        alias = conf.database()
        return with_state(super().get_queryset(request).using(alias), alias)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Lock | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Lock | None = None) -> bool:
        # Also removes the bulk "delete selected" action, which requires this permission.
        return False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The lock list. A POST naming an action from a user who may run none is refused
        with Django's "No action selected." warning.

        Django itself ignores such a POST silently (with no action available it does not
        build the action form at all) and shows the list as if nothing had been asked,
        which leaves a user who forged or replayed a break wondering what happened.
        """
        if (
            request.method == "POST" and "action" in request.POST
            and self.has_view_or_change_permission(request)
            and not self.get_actions(request)
        ):
            # Django's own words for an action that is not offered (and its translation).
            self.message_user(request, gettext("No action selected."), messages.WARNING)
            return HttpResponseRedirect(request.get_full_path())
        response = super().changelist_view(request, extra_context)
        context = getattr(response, "context_data", None)
        if context is not None and "cl" in context:
            context["distlock_search_hint"] = self._search_hint(context["cl"])
            context["distlock_held_by"] = held_by_term(
                request.GET.get(HeldByFilter.parameter_name))
        return response

    def _search_hint(self, cl: ChangeList) -> str:
        """What a search or a held-by lookup that found nothing looks at, and where
        else to look; "" when something was found or nothing was asked."""
        if cl.result_count:
            return ""
        holder = held_by_term(cl.params.get(HeldByFilter.parameter_name))
        if holder:
            return format_html(
                "No held or expired lock has a holder containing “{}”: the held-by lookup "
                "looks at the holder text of the locks that are owned now (any case, any "
                "part of it); a free lock has no holder.", holder,
            )
        term = cl.query.strip()
        if not term:
            return ""
        url = f"?{urlencode({HeldByFilter.parameter_name: term})}"
        return format_html(
            "No lock name starts with “{}”: the search looks at lock names only, at their "
            "start, case-sensitive. To find the locks a worker holds, look up its holder: "
            '<a href="{}" id="distlock-held-by-suggestion">held by “{}”</a>.',
            term, url, term,
        )

    # --- columns ---------------------------------------------------------------------

    # Not sortable: the state is a CASE over the clock, so sorting by it computes it for
    # every row of the table (a million rows: a full scan and sort). The state filter
    # lists the held or expired ones through the owned rows' index instead.
    @admin.display(description="state")
    def state_badge(self, obj: LockWithState) -> str:
        return badge(obj.state)

    @admin.display(description="holder", ordering="holder")
    def holder_cut(self, obj: Lock) -> str:
        # The owner under the holder, not a column of its own: the list must fit 1366 px.
        return format_html("{}{}", holder_text(obj.holder), short_owner(obj.owner))

    @admin.display(description="acquired", ordering="acquired_us")
    def acquired(self, obj: LockWithState) -> str:
        return clock_and_relative(obj.acquired_us, obj.db_now_us)

    @admin.display(description="expires", ordering="expires_us")
    def expires(self, obj: LockWithState) -> str:
        # A free row's expires_us is its release time, not a deadline.
        if obj.is_free:
            return freed(obj, obj.db_now_us)
        return clock_and_relative(obj.expires_us, obj.db_now_us)

    @admin.display(description="renewed", ordering="renew_count")
    def renewed(self, obj: LockWithState) -> str:
        if not obj.renew_count or obj.renewed_us is None:
            return format_html('<span class="distlock-quiet">{}</span>', "never")
        times = "once" if obj.renew_count == 1 else f"{obj.renew_count} times"
        return format_html('{}<span class="distlock-relative">{}</span>', times,
                           relative(obj.renewed_us, obj.db_now_us))

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """One history per lock: with audit on, the lock's page's "History" is its audit
        events, where admin breaks are recorded too (docs/operations.md). With audit off,
        Django's log, where admin breaks are then recorded, is the only history."""
        if not conf.AUDIT:
            return super().history_view(request, object_id, extra_context)
        obj = self.get_object(request, unquote(object_id))
        if obj is None or not self.has_view_permission(request, obj):
            return super().history_view(request, object_id, extra_context)
        url = reverse(f"{self.admin_site.name}:distlock_lockevent_changelist")
        return HttpResponseRedirect(f"{url}?{urlencode({'name__exact': obj.name})}")

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """The lock's page, with a Break button for users who may break a lock that is
        not free. The button opens the action's own confirmation page."""
        obj = self.get_object(request, unquote(object_id))
        context = {
            **(extra_context or {}),
            "distlock_can_break": obj is not None and not obj.is_free
            and self.has_break_permission(request),
            "distlock_action_checkbox_name": ACTION_CHECKBOX_NAME,
        }
        return super().change_view(request, object_id, form_url, context)

