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
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import quote, unquote
from django.contrib.admin.views.main import ChangeList
from django.db.models import BooleanField, Count, QuerySet
from django.db.models.expressions import RawSQL
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.utils.translation import gettext

from distlock.admin.display import (
    badge,
    clock_and_relative,
    freed,
    holder_text,
    mark_freed,
    short_owner,
)
from distlock.admin.paging import CappedPaginator, SortedWhereBounded, sortable_columns
from distlock.admin.search import HELP_TEXT, NameSearch
from distlock.admin.views.overview import fragment as overview_fragment
from distlock.admin.views.overview import page as overview_page
from distlock.admin.views.timeline import URL_NAME as TIMELINE_URL_NAME
from distlock.admin.views.timeline import timeline_url
from distlock.backends.indexes import RARE_KINDS_SQL
from distlock.conf import conf
from distlock.constants import HOLDER_LENGTH
from distlock.core.inspection import LockStatus, lock_status
from distlock.core.locks import break_lock
from distlock.core.status import (
    EXPIRED,
    FREE,
    HELD,
    LockWithState,
    duration,
    relative,
    state_is,
    with_state,
)
from distlock.db import db_now_us
from distlock.exceptions import TransactionNotAllowed
from distlock.models import Lock, LockEvent
from distlock.times import EPOCH
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


class HeldByFilter(admin.SimpleListFilter):
    """``?holder=worker-7``: the locks a worker holds, those whose holder text contains
    the term (any case), held or expired (a free lock has no holder).

    The holder has no index; the owned rows' does (``owner > ''``, migration 0001), so the
    lookup reads what is owned, never the whole table. The box for it sits under the
    search box (templates/admin/distlock/lock/change_list.html)."""

    title = "held by"
    parameter_name = "holder"

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        # Only the term asked for: a list of every holder would read every owned row.
        term = held_by_term(self.value())
        return [(self.value() or "", f"“{term}”")] if term else []

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        term = held_by_term(self.value())
        if not term:
            return queryset
        if len(term) > HOLDER_LENGTH or "\x00" in term:
            return queryset.none()  # no holder text can contain it
        return queryset.filter(owner__gt="", holder__icontains=term)


def held_by_term(value: str | None) -> str:
    """The part of a holder text ``?holder=`` asks for, white space around it dropped."""
    return (value or "").strip()


# The lock page's window of recent events.
HOUR_US = 3600 * 1_000_000


@dataclass(frozen=True)
class LockFacts:
    """What a lock's page says beside its row: its status (``lock_status``: held for,
    waiters), the audit's last hour of it and its latest break."""

    status: LockStatus
    now_us: int
    grants: int
    took_over: int
    stale: int
    broken: LockEvent | None


def lock_facts(name: str, alias: str) -> LockFacts:
    """Lock ``name``'s status and its audit's last hour (through the events'
    ``(name, at_us)`` index) and latest break (a rare kind: the rare kinds' index)."""
    status = lock_status(name, using=alias)
    now_us = (status.db_now - EPOCH) // timedelta(microseconds=1)
    events = LockEvent.objects.using(alias).filter(name=name)
    counts = {
        row["kind"]: row["n"]
        for row in events.filter(at_us__gte=now_us - HOUR_US)
        .values("kind").annotate(n=Count("id")).order_by()
    }
    broken = (
        events.filter(kind=LockEvent.Kind.BROKEN)
        .filter(RawSQL(RARE_KINDS_SQL, [], output_field=BooleanField()))
        .order_by("-at_us", "-id").first()
    )
    took_over = counts.get(LockEvent.Kind.TOOK_OVER, 0)
    return LockFacts(
        status=status, now_us=now_us,
        grants=counts.get(LockEvent.Kind.ACQUIRED, 0) + took_over, took_over=took_over,
        stale=counts.get(LockEvent.Kind.STALE_WRITE, 0), broken=broken,
    )


def _exact(us: int | None, now_us: int) -> SafeString:
    """A time on a lock's page: "2026-12-03 17:37:49.120 IST (in 4 min)"."""
    return clock_and_relative(us, now_us, inline=True, exact=True)


def _plural(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


@admin.register(Lock)
class LockAdmin(NameSearch, _LockAdminBase):
    list_display = [
        "name", "state_badge", "holder_cut", "token", "acquired", "expires", "renewed",
    ]
    list_filter = [StateFilter, HeldByFilter]
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
        "renewed_at", "expires_at", "waiters", "last_hour", "broken_by", "history",
    )
    # A free lock has no expiry: its page says how and when it was freed instead.
    readonly_fields = (*fields, "freed_at")
    change_form_template = "admin/distlock/lock/change_form.html"
    change_list_template = "admin/distlock/lock/change_list.html"
    confirmation_template = "admin/distlock/lock/break_confirmation.html"

    class Media:
        css = _MEDIA_CSS

    # --- read-only table -------------------------------------------------------------

    def get_fields(self, request: HttpRequest, obj: Lock | None = None) -> Any:
        if obj is not None and obj.is_free:
            return tuple("freed_at" if f == "expires_at" else f for f in self.fields)
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

    # The lock's own page: every time to the millisecond, in the site's time zone with
    # the zone shown, and how long ago or ahead by the database clock beside it.

    def _facts(self, obj: Lock) -> LockFacts:
        """The page's facts, read once per page (the fields below share them)."""
        facts: LockFacts | None = getattr(obj, "distlock_facts", None)
        if facts is None:
            facts = lock_facts(obj.name, conf.database())
            obj.distlock_facts = facts  # type: ignore[attr-defined]
        return facts

    @admin.display(description="held for")
    def held_for(self, obj: Lock) -> str:
        status = self._facts(obj).status
        if status.acquired_at is None:
            return "not held"
        seconds = (status.db_now - status.acquired_at).total_seconds()
        if status.held:
            return f"{duration(seconds)} (since acquired, by the database clock)"
        return f"{duration(seconds)} since acquired; the lease ran out and nobody took it over"

    @admin.display(description="acquired")
    def acquired_at(self, obj: LockWithState) -> str:
        return _exact(obj.acquired_us, obj.db_now_us)

    @admin.display(description="last renewal")
    def renewed_at(self, obj: LockWithState) -> str:
        if obj.renewed_us is None or not obj.renew_count:
            return "never renewed"
        return format_html(
            "{}, {}", _exact(obj.renewed_us, obj.db_now_us),
            _plural(obj.renew_count, "renewal", "renewals"),
        )

    @admin.display(description="expires")
    def expires_at(self, obj: LockWithState) -> str:
        if obj.state == EXPIRED:
            return format_html("ran out {} — nobody took it over; the next acquire will",
                               _exact(obj.expires_us, obj.db_now_us))
        return _exact(obj.expires_us, obj.db_now_us)

    @admin.display(description="freed")
    def freed_at(self, obj: LockWithState) -> str:
        # "broken 4 s ago by ops (admin)", said in the page, not only on hover.
        event = getattr(obj, "freed_by_event", None)
        how = freed(obj, obj.db_now_us)
        if event is not None and event.kind == LockEvent.Kind.BROKEN:
            how = format_html("broken {} by {}", relative(obj.expires_us, obj.db_now_us),
                              event.by or "?")
        return format_html("{} — {}", how, _exact(obj.expires_us, obj.db_now_us))

    @admin.display(description="waiting")
    def waiters(self, obj: Lock) -> str:
        count = self._facts(obj).status.waiters
        if count is None:
            return ("not known here: waiters on this database (or with DISTLOCK_WAKEUPS "
                    "off) poll the lock row and register nowhere")
        if count == 0:
            return "nobody is waiting"
        return _plural(count, "session waits", "sessions wait") + (
            " (a process, or one event loop for all its coroutines)")

    @admin.display(description="last hour")
    def last_hour(self, obj: Lock) -> str:
        facts = self._facts(obj)
        text = (
            f"{_plural(facts.grants, 'grant', 'grants')} "
            f"({_plural(facts.took_over, 'take-over', 'take-overs')}), "
            f"{_plural(facts.stale, 'stale write', 'stale writes')} refused"
        )
        if not conf.AUDIT:
            text += " (audit is off: DISTLOCK_AUDIT; nothing new is recorded)"
        return text

    @admin.display(description="last broken")
    def broken_by(self, obj: Lock) -> str:
        event = self._facts(obj).broken
        if event is None:
            return "never (as far as the audit history goes)"
        return format_html("by {}, {} (token {})", event.by or "?",
                           _exact(event.at_us, self._facts(obj).now_us), event.token)

    @admin.display(description="history")
    def history(self, obj: Lock) -> str:
        site = self.admin_site.name
        query = urlencode({"name__exact": obj.name})
        links = [
            ("distlock-events-link",
             f"{reverse(f'{site}:distlock_lockevent_changelist')}?{query}",
             "events of this lock"),
            ("distlock-timeline-link",
             f"{reverse(f'{site}:{TIMELINE_URL_NAME}')}?{urlencode({'name': obj.name})}",
             "its timeline"),
        ]
        return format_html_join(" · ", '<a id="{}" href="{}">{}</a>', links)

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
        back = self._lock_page_to_return_to(request)
        if request.POST.get("post") == "yes":
            self._break_confirmed(request)
            # From a lock's own page, back to it (it then says who broke it and when).
            return HttpResponseRedirect(back) if back else None
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
                    # The site's zone, the zone shown, how soon beside it: the
                    # one clock of every page (display.clock_and_relative).
                    "acquired": clock_and_relative(row.acquired_us, row.db_now_us, inline=True),
                    "expires": clock_and_relative(row.expires_us, row.db_now_us, inline=True),
                    "expect": json.dumps([row.name, row.owner, row.token]),
                }
                for row in breakable
            ],
            "free": [row for row in rows if row.is_free],
            "action_checkbox_name": ACTION_CHECKBOX_NAME,
            "changelist_url": back
            or reverse(f"{self.admin_site.name}:distlock_lock_changelist"),
            "distlock_return": bool(back),
            "distlock_zone": timezone.get_current_timezone_name(),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.confirmation_template, context)

    def _lock_page_to_return_to(self, request: HttpRequest) -> str:
        """The lock's page when the break began there (the Break… button sends
        ``distlock_return``) and named that one lock; else "" (the list). A lock name,
        never a URL, comes from the form: nothing can send the user elsewhere."""
        selected = request.POST.getlist(ACTION_CHECKBOX_NAME)
        if not request.POST.get("distlock_return") or len(selected) != 1:
            return ""
        return reverse(f"{self.admin_site.name}:distlock_lock_change",
                       args=[quote(selected[0])])

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
