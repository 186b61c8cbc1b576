"""Admin pages: the lock table (read-only, with a guarded "break" action and a Break
button on a held lock's page) and its overview page; the audit history's pages are in
:mod:`distlock.admin.events`, the overview's view in :mod:`distlock.admin.views.overview`.

Nothing here writes lock rows directly. Breaking goes through :func:`distlock.break_lock`
with the owner and token the confirmation page showed, so tokens keep increasing, the
``lock_broken`` signal fires, and a lock that changed hands in between is left alone.
Token, owner and expiry are never editable: an edited token would defeat fencing, and
deleting a row could let a name start again below a token already handed out.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.translation import gettext

from distlock.admin.display import (
    badge,
    cut,
    freed,
    mark_freed,
    precise,
    short_owner,
    when_and_relative,
)
from distlock.admin.paging import CappedPaginator, SortedWhereBounded, sortable_columns
from distlock.admin.search import HELP_TEXT, NameSearch
from distlock.admin.views.overview import fragment as overview_fragment
from distlock.admin.views.overview import page as overview_page
from distlock.admin.views.timeline import timeline_url
from distlock.conf import conf
from distlock.core.locks import break_lock
from distlock.core.status import (
    EXPIRED,
    FREE,
    HELD,
    LockWithState,
    relative,
    state_is,
    with_state,
)
from distlock.db import db_now_us
from distlock.exceptions import TransactionNotAllowed
from distlock.models import Lock
from distlock.validation import check_name, check_owner, check_token

if TYPE_CHECKING:
    # Generic in django-stubs only: Django's ModelAdmin cannot be subscripted at run time.
    _LockAdminBase = admin.ModelAdmin[Lock]
else:
    _LockAdminBase = admin.ModelAdmin

# The lists' widths, truncation and two-line time cells (the same for both lists).
_MEDIA_CSS = {"all": ("distlock/admin.css",)}


class _LockChangeList(SortedWhereBounded):
    """Django's list, and then, for the rows of the page only, how each free lock was
    freed (released or broken), from the audit: the lock row cannot tell."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        mark_freed(self.result_list, self.queryset.db)


class StateFilter(admin.SimpleListFilter):
    """Held / expired / free by the database clock, read once just before the listing
    query and compared with columns (``state_is``), so the owned rows' index serves it; a
    lease that ends between that reading and the query is listed under "held" with the
    badge "expired", which the query reads with the clock of its own instant."""

    title = "state"
    parameter_name = "state"

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        return [
            (HELD, "held"),
            (EXPIRED, "expired (not yet taken over)"),
            (FREE, "free"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value in (HELD, EXPIRED, FREE):
            return queryset.filter(state_is(value, db_now_us(queryset.db)))
        return queryset


@admin.register(Lock)
class LockAdmin(NameSearch, _LockAdminBase):
    list_display = [
        "name", "state_badge", "holder_cut", "token", "acquired", "expires", "renewed",
    ]
    list_filter = [StateFilter]
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
        "name", "state_badge", "holder", "owner", "token", "acquired_at", "renewed_at",
        "expires_at", "renew_count", "history",
    )
    readonly_fields = fields
    change_form_template = "admin/distlock/lock/change_form.html"
    change_list_template = "admin/distlock/lock/change_list.html"
    confirmation_template = "admin/distlock/lock/break_confirmation.html"

    class Media:
        css = _MEDIA_CSS

    # --- read-only table -------------------------------------------------------------

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

    def has_break_permission(self, request: HttpRequest) -> bool:
        """The dedicated ``distlock.break_lock`` permission (superusers have it)."""
        return request.user.has_perm(f"{self.opts.app_label}.break_lock")

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
        return super().changelist_view(request, extra_context)

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
        return format_html("{}{}", cut(obj.holder), short_owner(obj.owner))

    @admin.display(description="acquired", ordering="acquired_us")
    def acquired(self, obj: LockWithState) -> str:
        return when_and_relative(obj.acquired_us, obj.db_now_us)

    @admin.display(description="expires", ordering="expires_us")
    def expires(self, obj: LockWithState) -> str:
        # A free row's expires_us is its release time, not a deadline.
        if obj.is_free:
            return freed(obj, obj.db_now_us)
        return when_and_relative(obj.expires_us, obj.db_now_us)

    @admin.display(description="renewed", ordering="renew_count")
    def renewed(self, obj: LockWithState) -> str:
        if not obj.renew_count or obj.renewed_us is None:
            return format_html('<span class="distlock-quiet">{}</span>', "never")
        times = "once" if obj.renew_count == 1 else f"{obj.renew_count} times"
        return format_html('{}<span class="distlock-relative">{}</span>', times,
                           relative(obj.renewed_us, obj.db_now_us))

    # The lock's own page: every time to the millisecond, in the site's time zone.

    @admin.display(description="acquired")
    def acquired_at(self, obj: Lock) -> str:
        return precise(obj.acquired_us)

    @admin.display(description="renewed")
    def renewed_at(self, obj: Lock) -> str:
        return precise(obj.renewed_us) if obj.renewed_us is not None else "never"

    @admin.display(description="expires")
    def expires_at(self, obj: LockWithState) -> str:
        if obj.is_free:
            return format_html("{} ({})", freed(obj, obj.db_now_us), precise(obj.expires_us))
        return format_html("{} ({})", precise(obj.expires_us),
                           relative(obj.expires_us, obj.db_now_us))

    @admin.display(description="history")
    def history(self, obj: Lock) -> str:
        url = reverse(f"{self.admin_site.name}:distlock_lockevent_changelist")
        return format_html(
            '<a href="{}?{}">events of this lock</a>', url, urlencode({"name__exact": obj.name})
        )

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

    # --- breaking --------------------------------------------------------------------

    @admin.action(permissions=["break"], description="Break selected locks")
    def break_selected(
        self, request: HttpRequest, queryset: QuerySet[LockWithState]
    ) -> HttpResponse | None:
        """Show what would be broken; on confirmation break exactly what was shown."""
        if request.POST.get("post") == "yes":
            self._break_confirmed(request)
            return None
        rows = list(queryset)
        breakable = [row for row in rows if not row.is_free]
        context = {
            **self.admin_site.each_context(request),
            "title": "Break locks?",
            "subtitle": None,
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "queryset": rows,
            "breakable": [
                {
                    "lock": row,
                    "expires": relative(row.expires_us, row.db_now_us),
                    "expect": json.dumps([row.name, row.owner, row.token]),
                }
                for row in breakable
            ],
            "free": [row for row in rows if row.is_free],
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "changelist_url": reverse(f"{self.admin_site.name}:distlock_lock_changelist"),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.confirmation_template, context)

    def _parse_expected(self, request: HttpRequest) -> list[tuple[str, str, int]] | None:
        selected = set(request.POST.getlist(ACTION_CHECKBOX_NAME))
        expected = []
        try:
            for raw in request.POST.getlist("expect"):
                name, owner, token = json.loads(raw)
                expected.append((check_name(name), check_owner(owner), check_token(token)))
        except (TypeError, ValueError):
            return None
        return [item for item in expected if item[0] in selected]

    def _break_confirmed(self, request: HttpRequest) -> None:
        expected = self._parse_expected(request)
        if expected is None:
            self.message_user(
                request, "The confirmation was malformed; nothing was broken.", messages.ERROR
            )
            return
        alias = conf.database()
        by = f"{request.user.get_username()} (admin)"
        broken, changed = [], []
        for name, owner, token in expected:
            try:
                done = break_lock(name, owner=owner, token=token, using=alias, by=by)
            except TransactionNotAllowed as exc:  # ATOMIC_REQUESTS on the lock database
                self.message_user(request, f"Nothing more was broken: {exc}", messages.ERROR)
                break
            if done:
                broken.append(name)
                if not conf.AUDIT:
                    # The one record there can be: with audit on, the broken event (by
                    # "<user> (admin)") is the lock's history, and nothing is logged twice.
                    self.log_change(
                        request, Lock(name=name),
                        f"Broke the lock (token {token}, owner {owner}).",
                    )
            else:
                changed.append(name)
        if broken:
            self.message_user(
                request,
                f"Broke {len(broken)} lock(s): {', '.join(broken)}. Their holders' renewals, "
                "releases and fenced writes will fail; the next grant gets a higher token.",
                messages.SUCCESS,
            )
        for name in changed:
            now = with_state(Lock.objects.using(alias).filter(name=name), alias).first()
            state = (
                "it no longer exists" if now is None
                else f"it is now {now.state} with token {now.token}"
            )
            self.message_user(
                request,
                f"Did not break “{name}”: it changed hands since the confirmation page was "
                f"shown ({state}). Look again and break it anew if you still mean to.",
                messages.WARNING,
            )
        if not expected:
            self.message_user(request, "None of the selected locks was held.", messages.INFO)
