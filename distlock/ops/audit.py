"""The audit history: one LockEvent row per grant, renewal, release, break, loss and
refused stale write, recorded from distlock's signals while ``DISTLOCK_AUDIT`` is on.

The receivers are always connected (in ``DistlockConfig.ready``) and read the setting
each time, so ``override_settings`` and a settings change both work without reconnecting.

Recording must never break locking: the signals are sent after the lock change has
committed, so a failed audit insert cannot undo it, and raising from a receiver would hand
the caller an exception for a lock it actually holds. A failed insert is logged instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.apps import AppConfig
from django.core.checks import CheckMessage, Error
from django.db import DatabaseError, transaction
from django.db.models.expressions import Combinable
from django.dispatch import Signal

from distlock import signals
from distlock.conf import conf
from distlock.constants import PURGE_BATCH
from distlock.core.batches import in_batches
from distlock.core.status import database_now
from distlock.times import expiry_detail
from distlock.validation import check_seconds, check_using

if TYPE_CHECKING:
    from distlock.core.leases import Lease

logger = logging.getLogger("distlock.ops.audit")

#: LockEvent.detail's max_length.
DETAIL_LENGTH = 500

# dispatch_uid keeps a second ready() (tests that reload apps) from connecting twice.
_UID = "distlock.ops.audit."


def record(
    kind: str, *, name: str, using: str, token: int | None = None, owner: str = "",
    holder: str = "", by: str = "", detail: str = "",
) -> bool:
    """Insert one LockEvent on database ``using`` if audit is on; True if it was written.

    The event time is the database clock, read by the INSERT itself.
    """
    if not conf.AUDIT:
        return False
    from distlock.models import LockEvent

    try:
        # A savepoint if the caller is inside atomic(): a failed insert must not poison
        # the caller's transaction.
        with transaction.atomic(using=using):
            LockEvent.objects.using(using).create(
                at_us=database_now(using), kind=kind, name=name, token=token,
                owner=owner, holder=holder[:255], by=by[:255], detail=detail[:DETAIL_LENGTH],
            )
    except DatabaseError:
        logger.exception("distlock audit: could not record %s of lock %r", kind, name)
        return False
    return True


def _acquired(sender: type[Lease], lease: Lease, took_over: str = "", **kwargs: Any) -> None:
    from distlock.models import LockEvent

    # The lease's end goes into the detail: the timeline draws a grant that was taken
    # over up to its expiry, which no later event says.
    expires = expiry_detail(lease.expires_at) if lease.expires_at else ""
    if took_over:
        kind = LockEvent.Kind.TOOK_OVER
        detail = "; ".join(filter(None, [f"took over the expired lease of {took_over}", expires]))
    else:
        kind, detail = LockEvent.Kind.ACQUIRED, expires
    record(
        kind, name=lease.name, using=lease.using, token=lease.token, owner=lease.owner,
        holder=lease.holder, detail=detail,
    )


def _renewed(sender: type[Lease], lease: Lease, **kwargs: Any) -> None:
    record(
        "renewed", name=lease.name, using=lease.using, token=lease.token, owner=lease.owner,
        holder=lease.holder,
        detail=expiry_detail(lease.expires_at) if lease.expires_at else "",
    )


def _released(sender: type[Lease], lease: Lease, held: bool = True, **kwargs: Any) -> None:
    if lease.released_at is None:
        # The release changed nothing: the grant had been taken over or broken, which
        # the history already shows.
        return
    record(
        "released", name=lease.name, using=lease.using, token=lease.token, owner=lease.owner,
        holder=lease.holder, detail="" if held else "the lease had already expired",
    )


def _broken(
    sender: None, name: str, owner: str, token: int, holder: str, using: str, by: str = "",
    **kwargs: Any,
) -> None:
    record("broken", name=name, using=using, token=token, owner=owner, holder=holder, by=by)


def _lost(sender: type[Lease], lease: Lease, reason: str = "", **kwargs: Any) -> None:
    record(
        "lost", name=lease.name, using=lease.using, token=lease.token, owner=lease.owner,
        holder=lease.holder, detail=reason,
    )


def _stale_write(
    sender: object, lease: Lease, instance_token: int | None = None, reason: str = "",
    **kwargs: Any,
) -> None:
    model = getattr(getattr(sender, "_meta", None), "label", None) or repr(sender)
    row = "unknown" if instance_token is None else str(instance_token)
    # The reason first: "token 4 refused (row token 3)" alone read as if a higher token
    # had been refused; why (the lock now at token 5, the lease expired, broken,
    # released) is what an operator needs.
    head = f"write with token {lease.token} refused: {reason or 'stale lease'}"
    tail = f" ({model}; row token {row})"
    record(
        "stale_write", name=lease.name, using=lease.using, token=lease.token,
        owner=lease.owner, holder=lease.holder, detail=fit(head, tail),
    )


def fit(head: str, tail: str, limit: int = DETAIL_LENGTH) -> str:
    """``head + tail`` within ``limit`` characters: ``head`` (the part that matters) is
    cut with an ellipsis only once ``tail`` has been cut away."""
    text = head + tail
    if len(text) <= limit:
        return text
    if len(head) < limit:
        return head + tail[: limit - len(head) - 1] + "…"
    return head[: limit - 1] + "…"


def _receivers() -> list[tuple[Signal, Callable[..., None], str]]:
    return [
        (signals.lock_acquired, _acquired, "acquired"),
        (signals.lock_renewed, _renewed, "renewed"),
        (signals.lock_released, _released, "released"),
        (signals.lock_broken, _broken, "broken"),
        (signals.lock_lost, _lost, "lost"),
        (signals.stale_write_refused, _stale_write, "stale_write"),
    ]


def connect() -> None:
    """Connect the audit receivers to distlock's signals (idempotent)."""
    signals.connect_receivers(_receivers(), _UID)


def disconnect() -> None:
    """Disconnect them again (idempotent)."""
    signals.disconnect_receivers(_receivers(), _UID)


def follow_setting(**kwargs: Any) -> None:
    """Receivers connected only while DISTLOCK_AUDIT is on (ready() and setting_changed).

    With audit off (the default) a signal with no other receiver returns at once: every
    acquire and release sends one, and a receiver that only looks at the setting is a
    measurable part of their client CPU (see benchmarks/).
    """
    if kwargs.get("setting", "DISTLOCK_AUDIT") != "DISTLOCK_AUDIT":
        return
    if conf.AUDIT:
        connect()
    else:
        disconnect()


def retention() -> float | None:
    """``DISTLOCK_AUDIT_RETENTION`` in seconds (None: keep events forever)."""
    value = conf.AUDIT_RETENTION
    if value is None:
        return None
    seconds = check_seconds(value, "DISTLOCK_AUDIT_RETENTION")
    if seconds <= 0:
        raise ValueError(f"DISTLOCK_AUDIT_RETENTION must be positive, not {seconds}")
    return seconds


def purge_events(
    *, older_than: float | int | timedelta | None = None, using: str | None = None
) -> int:
    """Delete audit events older than ``older_than`` (default: the retention setting).

    Age is measured by the database clock, as the events' times are. Returns how many
    rows were deleted; 0 when retention is None and no ``older_than`` is given. Deletes
    in batches of ``PURGE_BATCH`` rows, one short transaction each (unless the caller
    holds a transaction open around it).
    Raises TypeError/ValueError for a bad age (nothing is deleted); on SQLite,
    OperationalError as :func:`distlock.purge_locks` does (the batches before it stay
    deleted).
    """
    if older_than is None:
        seconds = retention()
        if seconds is None:
            return 0
    else:
        seconds = check_seconds(older_than, "older_than")
        if seconds < 0:
            raise ValueError(f"older_than must not be negative, not {seconds}")
    alias = check_using(using)
    cutoff = database_now(alias) - round(seconds * 1e6)
    return sum(deleted for deleted, _ in event_batches(alias, cutoff))


def event_batches(
    alias: str, cutoff: int | Combinable, size: int | None = None, rest: float | None = None
) -> Iterator[tuple[int, float]]:
    """purge_events' batches of ``size`` events (default PURGE_BATCH), with a rest after
    each that deleted rows (distlock/core/batches.py): yields (rows deleted, seconds the batch
    took), for benchmarks/rows_purge.py to time them."""
    size = PURGE_BATCH if size is None else size

    def batch() -> tuple[int, bool]:
        deleted = purge_event_batch(alias, cutoff, size)
        return deleted, deleted == size

    return in_batches(alias, batch, rest)


def purge_event_batch(alias: str, cutoff: int | Combinable, size: int) -> int:
    """Delete up to ``size`` of the oldest events before ``cutoff`` (epoch µs, or an
    expression of the database clock); return how many. One batch of purge_events: the
    ids oldest first through the ``at_us`` index, then one DELETE by id, its own
    transaction in autocommit, so years of history never sit under one statement's
    locks and the recording of new events goes on beside it.
    A function of its own so that benchmarks/rows_purge.py can time each batch."""
    from distlock.models import LockEvent

    events = LockEvent.objects.using(alias)
    ids = list(
        events.filter(at_us__lt=cutoff).order_by("at_us").values_list("id", flat=True)[:size]
    )
    if not ids:
        return 0
    count, _ = events.filter(id__in=ids).delete()
    return count


def check_audit_settings(
    app_configs: Sequence[AppConfig] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """distlock.E020: DISTLOCK_AUDIT must be a bool; E021: retention must be valid."""
    errors: list[CheckMessage] = []
    if not isinstance(conf.AUDIT, bool):
        errors.append(Error(
            f"DISTLOCK_AUDIT must be True or False, not {conf.AUDIT!r}.", id="distlock.E020",
        ))
    try:
        retention()
    except (TypeError, ValueError) as exc:
        errors.append(Error(
            f"DISTLOCK_AUDIT_RETENTION is invalid: {exc}.",
            hint="Use a positive number of seconds, a timedelta, or None to keep events.",
            id="distlock.E021",
        ))
    return errors
