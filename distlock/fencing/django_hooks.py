"""The one place distlock overrides a private Django method: ``Model._do_update``.

Why it is needed: ``save(fence=lease)`` of an existing row must be Django's own UPDATE
made conditional (the fenced condition in its WHERE, ``fence_token`` set to the token),
and no plain save may write ``fence_token`` from the instance (it may be older than the
row's). Django has no public hook between "these are the values save() writes" and "run
the UPDATE": ``pre_save`` cannot change the WHERE, and a save() of our own would copy
Django's handling of ``update_fields``, deferred fields, parent tables,
``select_on_save`` and the save signals.

Signatures it matches (checked by tests/test_django_hooks.py, one test per series, and a
test that fails on a Django series not listed in :data:`DO_UPDATE_PARAMETERS`):

* Django 5.2: ``_do_update(self, base_qs, using, pk_val, values, update_fields,
  forced_update)``, returning True if a row was updated;
* Django 6.x: the same plus ``returning_fields``, returning the list of the updated
  rows' returned fields (empty if none was updated).

The override names the six parameters it reads and passes the rest through untouched,
and only tests the result's truth, so it serves both.

How save() reaches it: :func:`fencing_update` sets a context variable to a
:class:`FencedUpdate` for the length of Django's save() and resets it in a ``finally``.
A context variable rather than state on the instance (``instance.__dict__``, as before):
nothing lands on the user's object (copies, pickles, a field of that name); it is scoped
to exactly that save() call even when it raises; each thread and each asyncio task sees
its own (``asave()`` runs ``save()`` in a worker thread); and it names the instance, so
another row saved inside the save (a signal receiver) gets a plain save.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NoReturn, Protocol

import django
from django.db import models

from distlock.constants import FENCE_FIELD

#: Parameter names of ``django.db.models.Model._do_update`` the override is written for,
#: by Django series ((major, minor), or (major,) for every release of a major version).
DO_UPDATE_PARAMETERS: dict[tuple[int, ...], tuple[str, ...]] = {
    (5, 2): (
        "self", "base_qs", "using", "pk_val", "values", "update_fields", "forced_update",
    ),
    (6,): (
        "self", "base_qs", "using", "pk_val", "values", "update_fields", "forced_update",
        "returning_fields",
    ),
}


def expected_do_update_parameters(
    version: tuple[Any, ...] = django.VERSION,
) -> tuple[str, ...] | None:
    """The parameters the override expects on Django ``version``; None if never checked."""
    for series in (tuple(version[:2]), tuple(version[:1])):
        if series in DO_UPDATE_PARAMETERS:
            return DO_UPDATE_PARAMETERS[series]
    return None


class FencedUpdate(Protocol):
    """What one ``save(fence=)`` asks of its own UPDATE."""

    @property
    def instance(self) -> models.Model:
        """The instance being saved: only its UPDATE is fenced."""

    def narrow(
        self, base_qs: models.QuerySet[Any], pk_val: Any, values: list[Any],
    ) -> tuple[models.QuerySet[Any], list[Any]]:
        """``base_qs`` narrowed by the fenced condition, and ``values`` with the token."""

    def refused(self, base_qs: models.QuerySet[Any], pk_val: Any) -> NoReturn:
        """Raise: the fenced UPDATE matched no row."""


_current: ContextVar[FencedUpdate | None] = ContextVar("distlock_fenced_update", default=None)


@contextmanager
def fencing_update(update: FencedUpdate) -> Iterator[None]:
    """Fence ``update.instance``'s UPDATE within this block (one save() call)."""
    reset = _current.set(update)
    try:
        yield
    finally:
        _current.reset(reset)


class FencedUpdateHook(models.Model):
    """Abstract base of FencedModel: the ``_do_update`` override, kept apart from the rest."""

    class Meta:
        abstract = True

    def _do_update(
        self, base_qs: models.QuerySet[Any], using: str | None, pk_val: Any,
        values: Collection[Any], update_fields: Any, forced_update: bool,
        *args: Any, **kwargs: Any,
    ) -> Any:
        # Never write the token from the instance: it may be older than the row's.
        values = [value for value in values if value[0].attname != FENCE_FIELD]
        update = _current.get()
        if update is None or update.instance is not self or not self._updates_token(base_qs):
            return super()._do_update(
                base_qs, using, pk_val, values, update_fields, forced_update, *args, **kwargs
            )
        fenced_qs, values = update.narrow(base_qs, pk_val, values)
        # forced_update=True: no select_on_save SELECT first; the UPDATE decides.
        updated = super()._do_update(
            fenced_qs, using, pk_val, values, update_fields, True, *args, **kwargs
        )
        if not updated:
            update.refused(base_qs, pk_val)
        return updated

    def _updates_token(self, base_qs: models.QuerySet[Any]) -> bool:
        """True if ``base_qs`` updates the table that has the ``fence_token`` column (with
        parent tables, save() updates each one in turn)."""
        field = self._meta.get_field(FENCE_FIELD)
        return base_qs.model._meta.concrete_model is field.model._meta.concrete_model

