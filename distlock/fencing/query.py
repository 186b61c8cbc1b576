"""FencedQuerySet and FencedManager: fenced bulk writes, and plain writes that cannot lower
the high-water mark (they refuse to set ``fence_token``)."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from asgiref.sync import sync_to_async
from django.db import models
from django.db.models import Q
from django.db.models.options import Options

from distlock.constants import FENCE_FIELD
from distlock.fencing.conditions import (
    Fence,
    NameTest,
    name_after,
    name_test,
    refuse_other_lock,
)
from distlock.fencing.ownership import OtherLock, Refused, check_lease, fenced, lease_is_current
from distlock.fencing.templates import (
    constant_name,
    local_columns,
    name_fields,
    name_keys,
    resolve,
    stored_value,
)

if TYPE_CHECKING:
    from distlock.core.leases import Lease
    from distlock.fencing.ownership import LeaseHolds

M = TypeVar("M", bound=models.Model)


def _refuse_token(how: str) -> NoReturn:
    raise ValueError(f"{FENCE_FIELD} is written only by fenced writes{how}")


class FencedQuerySet(models.QuerySet[M]):
    """QuerySet with fenced bulk writes; plain ``update()`` stays unfenced."""

    def update(self, **kwargs: Any) -> int:
        """Plain, unfenced update. Refuses to set ``fence_token``: only fenced writes may."""
        if FENCE_FIELD in kwargs:
            _refuse_token("; use fenced_update(lease, ...)")
        return super().update(**kwargs)

    def bulk_update(self, objs: Iterable[M], fields: Iterable[str], *args: Any, **kwargs: Any,
                    ) -> int:
        """Plain, unfenced bulk_update. Refuses ``fence_token``: only fenced writes set it."""
        fields = list(fields)
        if FENCE_FIELD in fields:
            _refuse_token("")
        return super().bulk_update(objs, fields, *args, **kwargs)

    def bulk_create(
        self, objs: Iterable[M], batch_size: int | None = None, ignore_conflicts: bool = False,
        update_conflicts: bool = False, update_fields: Iterable[str] | None = None,
        unique_fields: Collection[str] | None = None,
    ) -> list[M]:
        """Plain, unfenced bulk_create. Refuses ``update_conflicts`` that would write
        ``fence_token`` of existing rows (an upsert is an UPDATE of them)."""
        if update_fields is not None:
            update_fields = list(update_fields)
            if update_conflicts and FENCE_FIELD in update_fields:
                _refuse_token(
                    "; leave it out of bulk_create(update_conflicts=True, update_fields=...)"
                )
        return super().bulk_create(
            objs, batch_size=batch_size, ignore_conflicts=ignore_conflicts,
            update_conflicts=update_conflicts, update_fields=update_fields,
            unique_fields=unique_fields,
        )

    def update_or_create(
        self, defaults: Any = None, create_defaults: Any = None, **kwargs: Any,
    ) -> tuple[M, bool]:
        """Plain, unfenced update_or_create. Refuses ``fence_token`` in ``defaults``."""
        if defaults and FENCE_FIELD in defaults:
            _refuse_token("; leave it out of update_or_create(defaults=...)")
        return super().update_or_create(
            defaults=defaults, create_defaults=create_defaults, **kwargs
        )

    def _fence_target(self, lease: Lease, changes: Iterable[str]) -> NameTest:
        model = self.model
        local = local_columns(model)
        for name in (*changes, FENCE_FIELD):
            if name not in local:
                raise ValueError(
                    f"fenced_update() writes one table: {name!r} is not a column of "
                    f"{model._meta.db_table}"
                )
        # Counted on the query as it is (a query that has no table yet reads one).
        if self.query.count_active_tables() > 1:
            # Django would pre-select the ids on MySQL and update them unconditionally.
            raise ValueError(
                "fenced_update() needs a filter on the model's own columns (no joins); "
                "filter by pk__in=... instead"
            )
        constant = constant_name(model)
        if constant is not None:
            if constant != lease.guard_name:
                refuse_other_lock(model, lease, constant, "rows")
            return NameTest(None, None)
        return name_test(model, lease.guard_name, required=True)

    def fenced_update(self, lease: Lease, **changes: Any) -> int:
        """Update every row of this queryset if ``lease`` may write all of them; the count.

        One conditional UPDATE (``fence_token <= lease.token`` and the row's lock name)
        sets ``fence_token`` to the lease's token, after the ownership check. All or
        nothing: if any row holds a newer token the whole update is rolled back and
        StaleToken is raised; if any row belongs to another lock, or would after the
        update (``changes`` to fields of the lock name: a value is compared before any
        SQL, an expression in the UPDATE's WHERE), ValueError.
        """
        lease = check_lease(lease)
        if FENCE_FIELD in changes:
            raise ValueError(f"fenced_update() sets {FENCE_FIELD} itself")
        same_name = self._fence_target(lease, changes)
        same_name = same_name._replace(after=self._name_after(lease, changes))

        def write(folded: LeaseHolds | None) -> int:
            return self._claim(Fence(lease.token, same_name, folded), lease, changes)

        return fenced(
            self.model, lease, self.db, write, self._row_token, "rows", one_statement=True
        )

    def _name_after(self, lease: Lease, changes: dict[str, Any]) -> Q | None:
        """:func:`~distlock.fencing.conditions.name_after` for ``changes``: None, a WHERE
        condition, or ValueError."""
        model = self.model
        fields = name_fields(model)
        if fields is not None and not any(key in name_keys(model) for key in changes):
            return None  # the common case, without resolving every key
        written = {resolve(model, key): value for key, value in changes.items()}
        assigned = {
            field: value if hasattr(value, "resolve_expression")
            else stored_value(model, field, field.name, value)
            for field, value in written.items() if fields is None or field in fields
        }
        return name_after(
            model, lease, assigned, written=[*written, model._meta.get_field(FENCE_FIELD)]
        )

    def fenced_delete(self, lease: Lease) -> tuple[int, dict[str, int]]:
        """Delete the rows of this queryset if ``lease`` may write all of them.

        The rows are first claimed by a conditional ``fenced_update`` (which locks them),
        then deleted the usual way (cascades and signals), in the same transaction.
        """
        lease = check_lease(lease)
        same_name = self._fence_target(lease, ())

        def write(folded: LeaseHolds | None) -> tuple[int, dict[str, int]]:
            self._claim(Fence(lease.token, same_name, folded), lease, {})
            return models.QuerySet.delete(self.filter(fence_token=lease.token))

        return fenced(self.model, lease, self.db, write, self._row_token, "rows")

    def _claim(self, fence: Fence, lease: Lease, changes: dict[str, Any]) -> int:
        """The conditional UPDATE of every row (setting ``fence_token``); its count.

        Rows the UPDATE skipped still match this queryset: any of them refuses them all
        (the caller's transaction rolls the update back). With the ownership check folded
        in, the statement itself also requires that no row would be skipped (unless the
        filter matches one row at most, which is all or nothing by itself), so it writes
        all rows or none and needs no transaction: while it holds the lock row's share
        lock no newer lease can be granted, so none can write meanwhile.
        """
        count = models.QuerySet.update(fence.narrow(self), **changes, fence_token=fence.token)
        if count and fence.holds is not None:
            return int(count)
        if self.filter(fence.refused()).exists():
            if self.filter(fence_token__gt=fence.token).exists():
                raise Refused(by_owner_check=False)
            name = fence.name
            if name.after is not None and (
                name.q is None or not self.filter(~name.q).exists()
            ):
                raise OtherLock(
                    f"lease for lock {lease.name!r} cannot move rows of "
                    f"{self.model._meta.label} to another lock: after this update some of "
                    "them would be guarded by another lock"
                )
            raise OtherLock(
                f"lease for lock {lease.name!r} cannot fence every row of this "
                f"queryset: some rows of {self.model._meta.label} are guarded by "
                "another lock"
            )
        if fence.holds is not None and not lease_is_current(lease, self.db):
            raise Refused(by_owner_check=True)
        return int(count)

    def _row_token(self) -> int | None:
        top = self.aggregate(top=models.Max(FENCE_FIELD))["top"]
        return None if top is None else int(top)

    def fenced_create(self, lease: Lease, **fields: Any) -> M:
        """Create a row under ``lease`` (ownership check, ``fence_token`` = the token)."""
        obj = self.model(**fields)
        obj.save(fence=lease, force_insert=True, using=self.db)  # type: ignore[call-arg]
        return obj

    # The async forms, in Django's naming and as its own aupdate()/acreate() are: the sync
    # write in Django's sync layer, so the ownership check and the write share one
    # transaction on the connection the caller's other ORM calls use.

    async def afenced_update(self, lease: Lease, **changes: Any) -> int:
        """fenced_update() for async code."""
        return await sync_to_async(self.fenced_update)(lease, **changes)

    async def afenced_delete(self, lease: Lease) -> tuple[int, dict[str, int]]:
        """fenced_delete() for async code."""
        return await sync_to_async(self.fenced_delete)(lease)

    async def afenced_create(self, lease: Lease, **fields: Any) -> M:
        """fenced_create() for async code."""
        return await sync_to_async(self.fenced_create)(lease, **fields)


class FencedManager(models.Manager.from_queryset(FencedQuerySet)):  # type: ignore[misc]
    """The default manager of fenced models: ``fenced_update``/``fenced_create`` and co."""


def is_fenced_manager(manager: object) -> bool:
    """True if ``manager``'s querysets are FencedQuerySets (they refuse to set the token)."""
    queryset_class = getattr(manager, "_queryset_class", None)
    return isinstance(queryset_class, type) and issubclass(queryset_class, FencedQuerySet)


def use_fenced_base_manager(opts: Options[Any]) -> None:
    """Make a fenced model's ``_base_manager`` its default manager, when that one is fenced
    and ``Meta.base_manager_name`` names none (called on ``class_prepared``).

    Django's base manager (related objects, ``refresh_from_db()``, the deletion collector)
    is otherwise a plain Manager, whose ``update(fence_token=0)`` would lower the
    high-water mark. Set on ``class_prepared``, not in ``FencedModel.Meta``: a child's own
    ``class Meta`` does not inherit that option, and as a Meta option it would add a
    migration to every fenced model (migrations read Meta's own attributes, and they leave
    out a base manager that is the default manager).
    """
    if opts.abstract or opts.base_manager_name:
        return
    default = opts.default_manager
    if default is not None and is_fenced_manager(default):
        opts.base_manager_name = default.name
        opts.__dict__.pop("base_manager", None)  # a cached_property, maybe computed already
