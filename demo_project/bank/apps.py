from __future__ import annotations

from django.apps import AppConfig


class BankConfig(AppConfig):
    """The demo's fenced account balance and the record of every task attempt on it."""

    name = "demo_project.bank"
    default_auto_field = "django.db.models.BigAutoField"
