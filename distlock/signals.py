"""Signals sent by distlock, after the database change they report has committed.

``lock_acquired``        sender=Lease class; lease, took_over (holder of the expired
                         lease this grant replaced, or ""), waited (seconds from the call
                         to the try that got the lock)
``lock_not_acquired``    sender=Lease class; name, using, timed_out (False: a try that was
                         not to wait found the lock held; True: the timeout ran out),
                         waited (seconds)
``lock_released``        sender=Lease class; lease, held (False if it had expired)
``lock_renewed``         sender=Lease class; lease (expires_at is the new expiry)
``lock_lost``            sender=Lease class; lease, reason (str)
``lock_broken``          sender=None; name, owner, token, holder, using, by (who broke it)
``stale_write_refused``  sender=the model class; lease, instance_token (may be None),
                         reason (str: "lease expired", "lock now at token 5"…)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from django.dispatch import Signal

# (signal, receiver, key): a receiver of distlock's own (audit, metrics) and the key that,
# after its owner's prefix, is its dispatch_uid.
Receivers = Iterable[tuple[Signal, Callable[..., None], str]]

# use_caching: receivers are looked up once per sender, not on every send (connect and
# disconnect clear the cache); acquire and release each send one. Without receivers a
# send then costs a dictionary lookup, so a signal on the grant path is almost free.
# Django keeps that cache by weak reference to the sender, so it only suits signals
# whose sender is a class.
lock_acquired = Signal(use_caching=True)
lock_not_acquired = Signal(use_caching=True)
lock_released = Signal(use_caching=True)
lock_renewed = Signal(use_caching=True)
lock_lost = Signal(use_caching=True)
lock_broken = Signal()
stale_write_refused = Signal()


def connect_receivers(receivers: Receivers, prefix: str) -> None:
    """Connect each receiver with dispatch_uid ``prefix + key``: connecting twice (a second
    ready(), a setting turned on again) keeps one connection."""
    for signal, receiver, key in receivers:
        signal.connect(receiver, dispatch_uid=prefix + key)


def disconnect_receivers(receivers: Receivers, prefix: str) -> None:
    """Disconnect what :func:`connect_receivers` connected (idempotent)."""
    for signal, receiver, key in receivers:
        signal.disconnect(receiver, dispatch_uid=prefix + key)
