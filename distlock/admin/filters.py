"""The lock list's filters: state by the database clock, "held by" a holder text, and the
elections' locks.

Both read through the owned rows' index (``owner > ''``, migration 0001) where they can,
never the whole lock table.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from distlock.constants import HOLDER_LENGTH, LEADER_MARK
from distlock.core.status import EXPIRED, FREE, HELD, state_is
from distlock.db import db_now_us


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


class LeaderFilter(admin.SimpleListFilter):
    """``?leader=yes``: the elections' locks held or expired now (distlock.leader writes
    :data:`~distlock.constants.LEADER_MARK` into their holder text), read through the owned
    rows' index as "held by" is."""

    title = "elections"
    parameter_name = "leader"

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        return [("yes", "leaders")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.filter(owner__gt="", holder__contains=LEADER_MARK)
        return queryset


def held_by_term(value: str | None) -> str:
    """The part of a holder text ``?holder=`` asks for, white space around it dropped."""
    return (value or "").strip()


