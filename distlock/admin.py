"""Admin pages: the lock table (read-only, with a guarded "break" action) and the audit
history.

Nothing here writes lock rows directly. Breaking goes through :func:`distlock.break_lock`
with the owner and token the confirmation page showed, so tokens keep increasing, the
``lock_broken`` signal fires, and a lock that changed hands in between is left alone.
Token, owner and expiry are never editable: an edited token would defeat fencing, and
deleting a row could let a name start again below a token already handed out.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, reverse
from django.utils import formats, timezone
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.translation import gettext

from distlock.admin_timeline import timeline_url
from distlock.conf import conf
from distlock.exceptions import TransactionNotAllowed
from distlock.locks import break_lock
from distlock.models import Lock, LockEvent
from distlock.status import (
    EXPIRED,
    FREE,
    HELD,
    LockWithState,
    database_now,
    relative,
    with_state,
)
from distlock.times import from_us
from distlock.validation import check_name, check_owner, check_token

if TYPE_CHECKING:
    # Generic in django-stubs only: Django's ModelAdmin cannot be subscripted at run time.
    _LockAdminBase = admin.ModelAdmin[Lock]
    _LockEventAdminBase = admin.ModelAdmin[LockEvent]
else:
    _LockAdminBase = _LockEventAdminBase = admin.ModelAdmin

_BADGE_COLOURS = {
    HELD: "#1f7a1f",
    EXPIRED: "#b35900",
    FREE: "#666666",
    LockEvent.Kind.BROKEN: "#b30000",
    LockEvent.Kind.STALE_WRITE: "#b30000",
    LockEvent.Kind.LOST: "#b35900",
    LockEvent.Kind.TOOK_OVER: "#b35900",
}


def _badge(value: str, label: str | None = None) -> str:
    colour = _BADGE_COLOURS.get(value, "#205080")
    return format_html(
        '<span class="distlock-badge distlock-{}" style="background:{};color:#fff;'
        'padding:1px 6px;border-radius:8px;white-space:nowrap">{}</span>',
        value, colour, label or value,
    )


def _when(value: datetime | None) -> str:
    if value is None:
        return ""
    # template_localtime, as templates do: converts only when USE_TZ is on. Missing from
    # django-stubs, hence the ignore.
    local = timezone.template_localtime(value)  # type: ignore[attr-defined]
    return str(formats.localize(local))


class StateFilter(admin.SimpleListFilter):
    """Held / expired / free, judged by the database clock in the listing query itself."""

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
        if self.value() in (HELD, EXPIRED, FREE):
            return queryset.filter(state=self.value())
        return queryset


@admin.register(Lock)
class LockAdmin(_LockAdminBase):
    list_display = [
        "name", "state_badge", "holder", "short_owner", "token", "acquired", "expires",
        "renew_count",
    ]
    list_filter = [StateFilter]
    search_fields = ["name", "holder", "owner"]
    ordering = ["name"]
    # A filtered or searched list counts its own rows only: Django's default also counts
    # the whole table for "(n total)", a second full scan on a large lock table. Facet
    # counts would scan it once per filter choice (benchmarks/rows.py).
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    actions = ["break_selected"]
    # Tuples: django-stubs types fields and readonly_fields differently, and only a tuple
    # (immutable, so covariant) suits both.
    fields = (
        "name", "state_badge", "holder", "owner", "token", "acquired", "renewed", "expires",
        "renew_count", "history",
    )
    readonly_fields = fields
    confirmation_template = "admin/distlock/lock/break_confirmation.html"

    # --- read-only table -------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        # The timeline of several locks (distlock/admin_timeline.py); the lock's own page
        # shows its picture through templates/admin/distlock/lock/change_form.html.
        return [timeline_url(self), *super().get_urls()]

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

    @admin.display(description="state", ordering="state")
    def state_badge(self, obj: LockWithState) -> str:
        return _badge(obj.state)

    @admin.display(description="owner", ordering="owner")
    def short_owner(self, obj: Lock) -> str:
        return f"{obj.owner[:8]}…" if obj.owner else ""

    @admin.display(description="acquired", ordering="acquired_us")
    def acquired(self, obj: Lock) -> str:
        return _when(obj.acquired_at)

    @admin.display(description="renewed", ordering="renewed_us")
    def renewed(self, obj: Lock) -> str:
        return _when(obj.renewed_at)

    @admin.display(description="expires", ordering="expires_us")
    def expires(self, obj: LockWithState) -> str:
        # A free row's expires_us is its release time, not a deadline.
        if obj.is_free:
            when = relative(obj.expires_us, obj.db_now_us)
            return f"released {when}" if when else ""
        return format_html(
            "{} <span class=\"distlock-relative\">({})</span>", _when(obj.expires_at),
            relative(obj.expires_us, obj.db_now_us),
        )

    @admin.display(description="audit history")
    def history(self, obj: Lock) -> str:
        url = reverse(f"{self.admin_site.name}:distlock_lockevent_changelist")
        return format_html(
            '<a href="{}?{}">events of this lock</a>', url, urlencode({"name__exact": obj.name})
        )

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
        return queryset.filter(at_us__gte=database_now(queryset.db) - span * 1_000_000)


@admin.register(LockEvent)
class LockEventAdmin(_LockEventAdminBase):
    list_display = ["at", "kind_badge", "name", "token", "holder", "by", "detail"]
    list_filter = ["kind", AgeFilter]
    search_fields = ["name", "holder", "owner", "by"]
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    fields = ("at", "kind_badge", "name", "token", "owner", "holder", "by", "detail")
    readonly_fields = fields
    list_per_page = 100

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
        return _when(from_us(obj.at_us))

    @admin.display(description="event", ordering="kind")
    def kind_badge(self, obj: LockEvent) -> str:
        return _badge(obj.kind, obj.get_kind_display())
