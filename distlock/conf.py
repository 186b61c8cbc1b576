"""Settings, read from ``django.conf.settings`` on first access, never at import time.

Each value is remembered after its first read and forgotten whenever Django announces a
change of a ``DISTLOCK_*`` setting (``setting_changed``, which ``override_settings`` and
pytest-django's ``settings`` fixture send), so overrides work as with a fresh read. The
memo is there for speed: an unset setting costs Django an AttributeError on every read,
and acquire and release read several (a few µs each on the hot path, see benchmarks/).
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.conf import settings as django_settings
from django.core.signals import setting_changed
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
    # PostgreSQL: a waiting acquire LISTENs and a release NOTIFYs it (see wakeups.py).
    # Turn off behind a transaction-pooling PgBouncer, which cannot keep a LISTEN.
    "DISTLOCK_WAKEUPS": True,
    # PostgreSQL: a waiter that finds fewer than this many queued ahead of it LISTENs; a
    # later one waits behind the one just ahead until it is the head (see
    # docs/waiting.md). 1: only the head listens (the chain).
    "DISTLOCK_LISTENING_WAITERS": 8,
    # PostgreSQL: prepare distlock's own statements once per database session, so the
    # server does not parse and plan every lock operation. Turn off behind a
    # transaction-pooling PgBouncer older than 1.21 (or with max_prepared_statements = 0).
    "DISTLOCK_PREPARE_STATEMENTS": True,
    # PostgreSQL: let a release commit without waiting for its WAL flush. A release lost
    # in a database crash leaves the lock held until that lease's expiry, as a crashed
    # holder does; grants and renewals always wait (see postgresql_functions.py).
    "DISTLOCK_DURABLE_RELEASE": False,
    # Lease policies every grant gets unless its call says otherwise (seconds or
    # timedelta; None: none). See docs/lease-policies.md.
    # A release before acquired + MIN_HOLD keeps the lock until then (lockAtLeastFor).
    "DISTLOCK_MIN_HOLD": None,
    # Renewals stop at acquired + MAX_HOLD: the lease ends there.
    "DISTLOCK_MAX_HOLD": None,
    # After a lease ends without a release, or is broken, the name waits this long.
    "DISTLOCK_LOCK_DELAY": None,
    # PostgreSQL: every new session compares the server's timeline with the one the token
    # floor recorded; the first session on a promoted standby raises every token and ends
    # every lease (distlock.ops.failover.follow_timeline), so a failover needs no
    # `distlock_failover` step. One statement per new connection.
    "DISTLOCK_FOLLOW_TIMELINE": True,
    # Record lock events in the audit history (LockEvent).
    "DISTLOCK_AUDIT": False,
    # Audit events older than this many seconds (or timedelta) are deleted by
    # `manage.py distlock_purge`; None keeps them forever.
    "DISTLOCK_AUDIT_RETENTION": 30 * 24 * 3600.0,
    # distlock.contrib.prometheus: dotted path of the function that turns a lock name
    # into the `lock` label of the metrics (its pattern: invoice:42 -> invoice:*), so the
    # label set stays bounded however many names are locked.
    "DISTLOCK_METRICS_NAME_PATTERN": "distlock.contrib.prometheus.labels.name_pattern",
}


class Settings:
    """Attribute access to the ``DISTLOCK_*`` settings with their defaults.

    A value read once is kept as an attribute of the instance, so the next read is a
    plain attribute lookup: ``__getattr__`` runs only for a setting not read yet.
    """

    def __getattr__(self, name: str) -> Any:
        key = f"DISTLOCK_{name}"
        if key not in DEFAULTS:
            raise AttributeError(name)
        value = getattr(django_settings, key, DEFAULTS[key])
        self.__dict__[name] = value
        return value

    def forget(self, **kwargs: Any) -> None:
        """Drop remembered values (the ``setting_changed`` receiver)."""
        if str(kwargs.get("setting", "")).startswith("DISTLOCK_"):
            self.__dict__.clear()

    def database(self) -> str:
        """The alias of the lock table's database."""
        alias: str | None = self.DATABASE
        if alias is None:
            # Looked up in the app registry, not imported: settings know nothing of models.
            alias = router.db_for_write(apps.get_model("distlock", "Lock")) or "default"
        return alias


conf = Settings()
setting_changed.connect(conf.forget, dispatch_uid="distlock.conf.forget")
