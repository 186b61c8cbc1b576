"""The lock's own page: what it says beside the row (held for, last renewal, waiters, the
last hour, who broke it, links to its history), as the lock admin's read-only fields.

Every time is to the millisecond, in the site's time zone with the zone shown, and how long
ago or ahead by the database clock beside it (:func:`distlock.admin.display.clock_and_relative`).
The facts are read once per page (``lock_facts``) and shared by the fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from django.contrib import admin
from django.db.models import BooleanField, Count
from django.db.models.expressions import RawSQL
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import SafeString

from distlock.admin.bases import LockModelAdmin
from distlock.admin.display import clock_and_relative, freed
from distlock.admin.views.timeline import URL_NAME as TIMELINE_URL_NAME
from distlock.backends.indexes import RARE_KINDS_SQL
from distlock.conf import conf
from distlock.core.inspection import LockStatus, lock_status
from distlock.core.policies import DELAY_OWNER, named, seconds_text
from distlock.core.status import EXPIRED, HELD, LockWithState, duration, relative
from distlock.models import Lock, LockEvent
from distlock.times import EPOCH

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


class LockPage(LockModelAdmin):
    """The page's fields; :class:`distlock.admin.locks.LockAdmin` lists them in
    ``fields``."""

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

    @admin.display(description="leader election")
    def leader_term(self, obj: LockWithState) -> str:
        """An election's lock (distlock.leader): the term is the token; since when it leads
        and whether that term still stands, by the database clock."""
        acquired = _exact(obj.acquired_us or 0, obj.db_now_us)
        if obj.state == HELD:
            return format_html("term {}, leading since {}", obj.token, acquired)
        return format_html(
            "term {} ran out (led from {}); the next campaign elects term {} or later",
            obj.token, acquired, obj.token + 1)

    @admin.display(description="lease policies")
    def lease_policies(self, obj: LockWithState) -> str:
        """The grant's min_hold/max_hold/lock_delay (named in its holder text), each with
        the moment it sets by the database clock; a lock-delay with both ends: the
        holder's lease and the row's, until which nobody else is granted it."""
        found = named(obj.holder) if obj.owner else {}
        if not found:
            return "none"
        now, acquired, expires = obj.db_now_us, obj.acquired_us or 0, obj.expires_us or 0
        parts = []
        least = found.get("min_hold")
        if least is not None:
            parts.append(format_html(
                "min_hold {}: a release before {} keeps it until then",
                seconds_text(least), _exact(acquired + round(least * 1e6), now)))
        most = found.get("max_hold")
        if most is not None:
            parts.append(format_html(
                "max_hold {}: no renewal past {}", seconds_text(most),
                _exact(acquired + round(most * 1e6), now)))
        delay = found.get("lock_delay")
        if delay is not None:
            lease_end = expires - round(delay * 1e6)
            whose = "the broken lease ended" if obj.owner == DELAY_OWNER else "the lease ends"
            parts.append(format_html(
                "lock_delay {}: {} {}, the row {} (nobody else is granted it before)",
                seconds_text(delay), whose, _exact(lease_end, now), _exact(expires, now)))
        return format_html_join("; ", "{}", ((part,) for part in parts))

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

