"""Admin list of the uniqueness keys of enqueue_once() (TaskKey): read-only.

Which keys have a task queued, which a run running, until when by the database clock, and
whether a queued run waits in its worker for the running one. Nothing here is editable:
a key's slots end by themselves (at their end by the database clock), and a slot cleared
by hand would let a second copy of a task run beside the first.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.http import HttpRequest
from django.utils.safestring import SafeString

from distlock.admin.display import clock_and_relative
from distlock.db import db_now_us
from distlock.models import TaskKey
from distlock.times import to_us

if TYPE_CHECKING:
    TaskKeyModelAdmin = admin.ModelAdmin[TaskKey]
else:
    TaskKeyModelAdmin = admin.ModelAdmin


class _TaskKeyChangeList(ChangeList):
    """The list, with the database clock read once for its "in 3 s" / "2 min ago"."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        now_us = db_now_us(self.queryset.db) if self.result_list else 0
        for key in self.result_list:
            key.db_now_us = now_us


@admin.register(TaskKey)
class TaskKeyAdmin(TaskKeyModelAdmin):
    list_display = ["name", "task", "policy", "queued", "running", "waiting", "generation"]
    list_filter = ["policy"]
    search_fields = ["name"]
    fields = (
        "name", "task", "policy", "generation", "ttl_us", "enqueued", "queued", "running",
        "running_owner", "waiting",
    )
    readonly_fields = fields
    list_per_page = 100
    show_full_result_count = False

    class Media:
        css = {"all": ("distlock/admin.css",)}

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return _TaskKeyChangeList

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: str | None = None
    ) -> TaskKey | None:
        obj = super().get_object(request, object_id, from_field)
        if obj is not None:
            obj.db_now_us = db_now_us(self.get_queryset(request).db)  # type: ignore[attr-defined]
        return obj

    @admin.display(description="enqueued")
    def enqueued(self, obj: TaskKey) -> SafeString:
        return clock_and_relative(obj.enqueued_us, _now_us(obj))

    @admin.display(description="queued until")
    def queued(self, obj: TaskKey) -> SafeString:
        return _slot(obj.queued_until_us, _now_us(obj))

    @admin.display(description="running until")
    def running(self, obj: TaskKey) -> SafeString:
        return _slot(obj.running_until_us, _now_us(obj))

    @admin.display(description="queued run waiting since")
    def waiting(self, obj: TaskKey) -> SafeString:
        return clock_and_relative(obj.waiting_us, _now_us(obj))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: TaskKey | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: TaskKey | None = None) -> bool:
        return False


def _slot(until_us: int | None, now_us: int) -> SafeString:
    """A slot's end, or "free" when it has none or it has passed (by the database clock)."""
    if until_us is None or until_us <= now_us:
        return SafeString("free")
    return clock_and_relative(until_us, now_us)


def _now_us(obj: TaskKey) -> int:
    now_us: int | None = getattr(obj, "db_now_us", None)
    return now_us if now_us is not None else to_us(datetime.now(UTC))
