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

lock_acquired = Signal()
lock_released = Signal()
lock_renewed = Signal()
lock_lost = Signal()
lock_broken = Signal()
stale_write_refused = Signal()
