"""``{% lock_timeline lock %}``: the timeline picture on a lock's admin page.

A template tag rather than a field of LockAdmin, so the picture sits below the lock's
fields at full width (a read-only field squeezes it into the value column).
"""

from __future__ import annotations

from django import template
from django.urls import reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString

from distlock.admin.views.timeline import URL_NAME, picture
from distlock.conf import conf
from distlock.models import Lock

register = template.Library()


@register.simple_tag(takes_context=True)
def lock_timeline(context: template.Context, lock: Lock | None) -> SafeString | str:
    """The picture of ``lock`` under a "Timeline" heading (nothing for no lock)."""
    if lock is None:
        return ""
    request = context.get("request")
    site = getattr(request, "current_app", None) or "admin"
    url = reverse(f"{site}:{URL_NAME}") + "?" + urlencode({"name": lock.name})
    return format_html(
        '<fieldset class="module aligned" id="distlock-timeline">'
        '<h2 class="fieldset-heading">Timeline</h2>{}'
        '<p class="help"><a href="{}">Open on its own page</a> (add more <code>name=</code> '
        "to compare locks on one time axis).</p></fieldset>",
        picture([lock.name], conf.database(), label=f"timeline of lock {lock.name}",
                page_url=reverse(f"{site}:{URL_NAME}")),
        url,
    )
