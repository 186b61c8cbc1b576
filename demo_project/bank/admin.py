from __future__ import annotations

from django.contrib import admin

from demo_project.bank.models import Account, Attempt


@admin.register(Account)
class AccountAdmin(admin.ModelAdmin):
    list_display = ["id", "name", "balance", "fence_token"]
    readonly_fields = ["fence_token"]


@admin.register(Attempt)
class AttemptAdmin(admin.ModelAdmin):
    list_display = [
        "run", "mode", "task_no", "retry", "token", "pid", "read_balance", "paused",
        "taken_over_by", "wrote_balance", "outcome",
    ]
    list_filter = ["mode", "outcome"]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False
