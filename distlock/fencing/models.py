"""FencedModel: the abstract model whose rows refuse writes from stale lock holders.

``save(fence=)`` and ``delete(fence=)`` run under :func:`~distlock.fencing.ownership.fenced`
(the ownership check and the transaction) and narrow their UPDATE with the one fenced
condition (:class:`~distlock.fencing.conditions.Fence`); save() reaches Django's UPDATE
through :mod:`distlock.fencing.django_hooks`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from asgiref.sync import sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.db import models, router
from django.db.models import Q
from django.db.models.signals import class_prepared

from distlock.constants import FENCE_FIELD
from distlock.fencing.conditions import Fence, name_after, name_test, refuse_other_lock
from distlock.fencing.django_hooks import FencedUpdateHook, fencing_update
from distlock.fencing.ownership import OtherLock, Refused, check_lease, fenced, lease_is_current
from distlock.fencing.query import FencedManager, use_fenced_base_manager
from distlock.fencing.templates import (
    field_names,
    format_name,
    from_template,
    name_expression,
    name_fields,
    resolve,
    stored_value,
)

if TYPE_CHECKING:
    from distlock.core.leases import Lease
    from distlock.fencing.ownership import LeaseHolds


class FencedModel(FencedUpdateHook):
    """Abstract model whose rows refuse writes from stale lock holders.

    Declare the lock guarding each row with ``fence_name`` (a ``str.format`` template over
    field names, e.g. ``"account:{pk}"``) or override :meth:`get_fence_name` (and
    :meth:`get_fence_name_expression` for bulk writes). Write with ``save(fence=lease)``,
    ``delete(fence=lease)``, ``objects.filter(...).fenced_update(lease, ...)`` and
    ``objects.fenced_create(lease, ...)``.

    Writes without a fence are allowed (the admin, data migrations, fixtures) and never
    change ``fence_token``, so they cannot lower the high-water mark.
    """

    fence_token = models.BigIntegerField(
        default=0, editable=False,
        help_text="Highest fencing token that has written this row.",
    )

    #: ``str.format`` template over field names (``pk`` works) naming the guarding lock.
    fence_name: ClassVar[str | None] = None
    #: Run the ownership check when the lock table shares the model's database. Turning
    #: it off leaves only the high-water mark (see the README for what that misses).
    fence_check_ownership: ClassVar[bool] = True

    objects = FencedManager()

    class Meta:
        abstract = True

    def get_fence_name(self) -> str:
        """The name of the lock that guards this row (from ``fence_name`` by default)."""
        cls = type(self)
        if cls.fence_name is None:
            raise ImproperlyConfigured(
                f"{cls._meta.label} must set fence_name or override get_fence_name()"
            )
        return format_name(cls, cls.fence_name, self)

    @classmethod
    @from_template
    def get_fence_name_expression(cls) -> Any:
        """SQL expression of each row's lock name, or None if all rows share one name.

        Used by the conditional writes, so a lease can only write rows of its own lock.
        Built from ``fence_name``; override it together with :meth:`get_fence_name`.
        Raises NotImplementedError when there is no template to build it from.
        """
        if cls.fence_name is None:
            raise NotImplementedError(
                f"{cls._meta.label} overrides get_fence_name() without "
                "get_fence_name_expression(), so bulk fenced writes cannot check rows' "
                "lock names in SQL"
            )
        return name_expression(cls, cls.fence_name)

    def _fence_depends_on_missing_pk(self) -> bool:
        cls = type(self)
        if self.pk is not None or cls.fence_name is None:
            return False
        pk = cls._meta.pk
        return any(resolve(cls, name) is pk for name in field_names(cls.fence_name))

    def _check_fence_name(self, lease: Lease) -> None:
        name = self.get_fence_name()
        if name != lease.guard_name:
            refuse_other_lock(type(self), lease, name, f"pk={self.pk!r}")

    def save(self, *args: Any, fence: Lease | None = None, **kwargs: Any) -> None:
        """Save; with ``fence=lease`` only if the database agrees the lease is current.

        A new instance (or ``force_insert``) is inserted with ``fence_token`` = the
        lease's token; otherwise one conditional UPDATE writes the row, and matching no
        row raises StaleToken (nothing is written, the lease is marked lost). A lease of
        another lock raises ValueError, as does a write that would leave the row under
        another lock's name (an expression in a field of the name is refused). Without
        ``fence`` this is Django's save, except that ``fence_token`` is never written by an
        UPDATE.
        """
        if fence is None:
            super().save(*args, **kwargs)
            return
        if args:
            raise TypeError("pass save() options as keywords when using fence=")
        lease = check_lease(fence)
        cls = type(self)
        using = kwargs.get("using") or router.db_for_write(cls, instance=self)
        kwargs["using"] = using
        if kwargs.get("force_insert"):
            adding = True
        elif kwargs.get("force_update") or kwargs.get("update_fields") is not None:
            adding = False
        else:
            adding = self._state.adding
        name_after_insert = self._fence_depends_on_missing_pk()
        if not name_after_insert:
            self._check_fence_name(lease)
        else:
            # The name waits for the new pk; its other fields must already be values.
            pk = cls._meta.pk
            for name in field_names(cls.fence_name):  # type: ignore[arg-type]
                if (field := resolve(cls, name)) is not pk:
                    stored_value(cls, field, name, getattr(self, field.attname))
        if adding:
            kwargs["force_insert"] = True
        elif kwargs.get("update_fields") is None:
            kwargs["force_update"] = True
        old_pk, old_token = self.pk, self.fence_token

        def write(folded: LeaseHolds | None) -> None:
            if adding:
                self.fence_token = lease.token
            with fencing_update(_SaveUpdate(self, lease, folded)):
                super(FencedModel, self).save(**kwargs)
            if name_after_insert:
                name = self.get_fence_name()
                if name != lease.guard_name:
                    raise OtherLock(
                        f"lease for lock {lease.name!r} cannot fence the new "
                        f"{cls._meta.label}: it is guarded by lock {name!r}"
                    )

        # An UPDATE of a table without parent tables is one statement; an INSERT is not
        # (the lock name may need the new pk, and the ownership check must come first).
        one_statement = not adding and not cls._meta.parents
        try:
            fenced(
                cls, lease, using, write, lambda: self._row_token(using, self.pk),
                f"{cls._meta.label} pk={self.pk!r}", one_statement=one_statement,
            )
        except BaseException:
            self.fence_token = old_token
            if adding:
                self.pk = old_pk
                self._state.adding = True
            raise
        self.fence_token = lease.token

    def _row_token(self, using: str, pk: Any) -> int | None:
        """The stored ``fence_token`` of row ``pk`` (None if there is none), for messages."""
        if pk is None:
            return None
        value = (
            type(self)._base_manager.using(using).filter(pk=pk)
            .values_list(FENCE_FIELD, flat=True).first()
        )
        return None if value is None else int(value)

    async def asave(self, *args: Any, fence: Lease | None = None, **kwargs: Any) -> None:
        """save() for async code, as Django's own asave(): in its sync layer, so the
        ownership check and the write share one transaction on the caller's connection."""
        await sync_to_async(self.save)(*args, fence=fence, **kwargs)

    async def adelete(
        self, using: str | None = None, keep_parents: bool = False, *,
        fence: Lease | None = None,
    ) -> tuple[int, dict[str, int]]:
        """delete() for async code (see :meth:`asave`)."""
        return await sync_to_async(self.delete)(using, keep_parents, fence=fence)

    def delete(
        self, using: str | None = None, keep_parents: bool = False, *,
        fence: Lease | None = None,
    ) -> tuple[int, dict[str, int]]:
        """Delete; with ``fence=lease`` only if the database agrees the lease is current.

        The row is first claimed by a conditional UPDATE of ``fence_token`` (refusals as
        for save), then deleted the usual way, with cascades and signals, in the same
        transaction.
        """
        if fence is None:
            return super().delete(using=using, keep_parents=keep_parents)
        lease = check_lease(fence)
        cls = type(self)
        using = using or router.db_for_write(cls, instance=self)
        if self.pk is None:
            raise ValueError(f"{cls._meta.label} object can't be deleted: its pk is None")
        self._check_fence_name(lease)
        pk = self.pk

        def write(folded: LeaseHolds | None) -> tuple[int, dict[str, int]]:
            fence = Fence(lease.token, name_test(cls, lease.guard_name, required=False))
            rows = fence.narrow(cls._base_manager.using(using).filter(pk=pk))
            if models.QuerySet.update(rows, fence_token=lease.token) == 0:
                raise Refused(by_owner_check=False)
            return super(FencedModel, self).delete(using=using, keep_parents=keep_parents)

        return fenced(
            cls, lease, using, write, lambda: self._row_token(using, pk),
            f"{cls._meta.label} pk={pk!r}",
        )


class _SaveUpdate:
    """What ``save(fence=)`` asks of its own UPDATE (a django_hooks.FencedUpdate)."""

    def __init__(self, instance: FencedModel, lease: Lease, folded: LeaseHolds | None) -> None:
        self.instance = instance
        self.lease = lease
        self.folded = folded
        self.fence: Fence | None = None

    def narrow(
        self, base_qs: models.QuerySet[Any], pk_val: Any, values: list[Any],
    ) -> tuple[models.QuerySet[Any], list[Any]]:
        """``base_qs`` narrowed by the fenced condition; ``values`` plus the token."""
        model, lease = type(self.instance), self.lease
        same_name = name_test(model, lease.guard_name, required=False)
        same_name = same_name._replace(after=_name_after_save(model, lease, values, pk_val))
        self.fence = Fence(lease.token, same_name, self.folded)
        field = model._meta.get_field(FENCE_FIELD)
        # Django filters base_qs by the pk next: one row at most.
        pins = [(base_qs.model._meta.pk, pk_val)]
        return self.fence.narrow(base_qs, pins=pins), [*values, (field, None, lease.token)]

    def refused(self, base_qs: models.QuerySet[Any], pk_val: Any) -> NoReturn:
        """Raise Refused (or OtherLock): the fenced UPDATE matched no row."""
        lease, fence = self.lease, self.fence
        assert fence is not None
        # Which condition failed only matters for the message and for marking the lease
        # lost; the statement already decided.
        lost = fence.holds is not None and not lease_is_current(lease, base_qs.db)
        if not lost and fence.name.after is not None:
            before = Fence(fence.token, fence.name._replace(after=None))
            if before.narrow(base_qs.filter(pk=pk_val)).exists():
                raise OtherLock(
                    f"lease for lock {lease.name!r} cannot save "
                    f"{self.instance._meta.label} pk={pk_val!r}: with the fields it "
                    "writes, the row would be guarded by another lock"
                )
        raise Refused(by_owner_check=lost)


def _name_after_save(
    model: type[FencedModel], lease: Lease, values: list[Any], pk_val: Any,
) -> Q | None:
    """:func:`~distlock.fencing.conditions.name_after` for an UPDATE by save(): needed only
    when it writes some fields of the name but not all (``update_fields``, deferred
    fields), as the name then mixes the instance's values and the row's. The pk counts as
    written: the UPDATE's WHERE pins it.
    """
    fields = name_fields(model)
    if fields is None:
        return None  # no SQL form: only the instance's name (checked) can be compared
    written = {value[0]: value[2] for value in values}
    if not any(field in fields for field in written):
        return None  # the row keeps its stored name, which the UPDATE's WHERE compares
    written[model._meta.pk] = pk_val
    of_name = [field for field in written if field in fields]
    if len(of_name) == len(fields):
        return None  # the instance's own name, already compared with the lease's
    assigned = {
        field: stored_value(model, field, field.name, written[field]) for field in of_name
    }
    return name_after(model, lease, assigned, written=written)


def _fenced_base_manager(sender: type[models.Model], **kwargs: Any) -> None:
    if issubclass(sender, FencedModel):
        use_fenced_base_manager(sender._meta)


class_prepared.connect(_fenced_base_manager, dispatch_uid="distlock.fenced_base_manager")
