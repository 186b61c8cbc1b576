"""``{% distlock_breadcrumbs "Overview" %}``: the admin's own breadcrumb markup for
distlock's pages of its own (the break confirmation, the overview, the timeline) and of
the pages it heads its own way (an event's page and its history, headed by the kind's
label).

The admin's stylesheet names the element of its breadcrumbs: ``div.breadcrumbs`` up to
Django 6.0, ``ol.breadcrumbs`` with one ``<li>`` per crumb from Django 6.1 (whose
``base.css`` no longer styles the ``div``). So the markup follows the running Django's,
as its own ``delete_confirmation.html`` writes it, and each version styles it.
"""

from __future__ import annotations

from typing import Any

import django
from django import template

register = template.Library()

#: The first Django whose admin writes (and styles) its breadcrumbs as ``<ol>``.
LISTED_FROM = (6, 1)


@register.inclusion_tag("admin/distlock/breadcrumbs.html", takes_context=True)
def distlock_breadcrumbs(
    context: template.Context, here: str, via: str = "", via_url: str = ""
) -> dict[str, Any]:
    """Home › the app › the model's list › ``here`` (the current page, not a link); with
    ``via`` and ``via_url``, the object's page between the list and ``here`` (an
    object's history)."""
    return {
        "opts": context["opts"],
        "here": here,
        "via": via,
        "via_url": via_url,
        "listed": django.VERSION[:2] >= LISTED_FROM,
    }
