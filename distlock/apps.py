from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class DistlockConfig(AppConfig):
    name = "distlock"
    verbose_name = "Distributed locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from distlock import checks as distlock_checks

        checks.register(distlock_checks.check_settings)
        checks.register(distlock_checks.check_database, checks.Tags.database)
        checks.register(distlock_checks.check_fenced_models, checks.Tags.models)

        from django.core.signals import setting_changed

        from distlock.ops import audit

        audit.follow_setting()
        # After conf's own receiver (connected at its import), so the new value is read.
        setting_changed.connect(audit.follow_setting, dispatch_uid="distlock.ops.audit.follow")
        checks.register(audit.check_audit_settings)

        from django.db.backends.signals import connection_created

        from distlock import db
        from distlock.ops import failover

        # Every new session: the vendor's per-session set-up, then the timeline follow.
        connection_created.connect(db.session_started, dispatch_uid="distlock.db.session_started")
        connection_created.connect(
            failover.follow_timeline, dispatch_uid="distlock.ops.failover.follow_timeline"
        )
