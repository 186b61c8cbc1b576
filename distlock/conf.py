"""Settings, read from ``django.conf.settings`` on every access.

Reading on access (never at import time) keeps ``override_settings`` working and lets a
project change a value without restarting anything that imported distlock.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings
from django.db import router

DEFAULTS: dict[str, Any] = {
    # Database alias of the lock table; None means "wherever the router writes Lock".
    "DISTLOCK_DATABASE": None,
    # Lease length in seconds when a call gives no ttl.
    "DISTLOCK_DEFAULT_TTL": 60.0,
    # The largest ttl accepted, in seconds: longer leases are almost always a mistake
    # (use auto_renew instead), and a crashed holder blocks others for the whole ttl.
    "DISTLOCK_MAX_TTL": 24 * 3600.0,
    # How long a blocking acquire waits when a call gives no timeout; None waits forever.
    "DISTLOCK_DEFAULT_TIMEOUT": None,
    # First and longest pause between tries of a blocking acquire, in seconds.
    "DISTLOCK_POLL_INTERVAL": 0.02,
    "DISTLOCK_POLL_MAX_INTERVAL": 1.0,
    # auto_renew renews after this fraction of the ttl has passed.
    "DISTLOCK_RENEW_FRACTION": 1 / 3,
    # Record lock events in the audit history (LockEvent).
    "DISTLOCK_AUDIT": False,
    # Audit events older than this many seconds (or timedelta) are deleted by
    # `manage.py distlock_purge`; None keeps them forever.
    "DISTLOCK_AUDIT_RETENTION": 30 * 24 * 3600.0,
}


class Settings:
    """Attribute access to the ``DISTLOCK_*`` settings with their defaults."""

    def __getattr__(self, name: str) -> Any:
        key = f"DISTLOCK_{name}"
        if key not in DEFAULTS:
            raise AttributeError(name)
        return getattr(django_settings, key, DEFAULTS[key])

    def database(self) -> str:
        """The alias of the lock table's database."""
        alias = self.DATABASE
        if alias is None:
            from distlock.models import Lock

            alias = router.db_for_write(Lock) or "default"
        return alias


conf = Settings()
