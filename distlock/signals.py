"""Signals sent by distlock, after the database change they report has committed.

``lock_acquired``        sender=Lease class; lease, took_over (holder of the expired
                         lease this grant replaced, or "")
``lock_released``        sender=Lease class; lease, held (False if it had expired)
``lock_renewed``         sender=Lease class; lease (expires_at is the new expiry)
``lock_lost``            sender=Lease class; lease, reason (str)
``lock_broken``          sender=None; name, owner, token, holder, using, by (who broke it)
``stale_write_refused``  sender=the model class; lease, instance_token (may be None)
"""

from __future__ import annotations

from django.dispatch import Signal

# use_caching: receivers are looked up once per sender, not on every send (connect and
# disconnect clear the cache); acquire and release each send one. Django keeps that cache
# by weak reference to the sender, so it only suits signals whose sender is a class.
lock_acquired = Signal(use_caching=True)
lock_released = Signal(use_caching=True)
lock_renewed = Signal(use_caching=True)
lock_lost = Signal(use_caching=True)
lock_broken = Signal()
stale_write_refused = Signal()
