"""The typed ``ModelAdmin`` bases of the operator UI's admins.

``ModelAdmin`` is generic in django-stubs only: subscripting it at run time raises, so the
subscripted form exists for the type checker alone. One place, shared by the lock admin's
parts (:mod:`~distlock.admin.locks`, :mod:`~distlock.admin.lock_page`,
:mod:`~distlock.admin.breaking`) and the events' admin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin

from distlock.models import Lock, LockEvent

if TYPE_CHECKING:
    LockModelAdmin = admin.ModelAdmin[Lock]
    LockEventModelAdmin = admin.ModelAdmin[LockEvent]
else:
    LockModelAdmin = admin.ModelAdmin
    LockEventModelAdmin = admin.ModelAdmin

__all__ = ["LockEventModelAdmin", "LockModelAdmin"]
