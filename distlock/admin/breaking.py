"""Breaking locks from the admin: the "Break selected locks" action, its confirmation page
and the Break button of a lock's page (which opens the same confirmation).

Breaking goes through :func:`distlock.break_lock` with the owner and token the confirmation
page showed, so tokens keep increasing, the ``lock_broken`` signal fires, and a lock that
changed hands in between is left alone. Only users with the dedicated
``distlock.break_lock`` permission see the action; a forged POST from others is refused.
"""

from __future__ import annotations

import json

from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.utils import quote
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone

from distlock.admin.bases import LockModelAdmin
from distlock.admin.display import clock_and_relative
from distlock.conf import conf
from distlock.core.locks import break_lock
from distlock.core.status import LockWithState, with_state
from distlock.exceptions import TransactionNotAllowed
from distlock.models import Lock
from distlock.validation import check_name, check_owner, check_token


class LockBreaking(LockModelAdmin):
    """The break action and what it needs; mixed into
    :class:`distlock.admin.locks.LockAdmin`."""

    confirmation_template = "admin/distlock/lock/break_confirmation.html"

    def has_break_permission(self, request: HttpRequest) -> bool:
        """The dedicated ``distlock.break_lock`` permission (superusers have it)."""
        return request.user.has_perm(f"{self.opts.app_label}.break_lock")




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
