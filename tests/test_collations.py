"""Exact lock names under every collation: the collation matrix of fenced writes.

DESIGN invariant 10 (issue 27, item 1): a fenced write leaves every row it touches named,
byte for byte as stored, by the lease's lock, whatever the collation of the columns its
``fence_name`` template reads. A collation that folds case, accents, trailing spaces,
canonical equivalents (``é`` and ``e`` + U+0301), widths or punctuation makes the
column's own ``=`` match a row of *another* lock: a filter ``key="abé"`` finds the row
stored as ``"ABé"``, which lock ``slug:ABé`` guards, not ``slug:abé``.

The matrix: every template column type (CharField, SlugField, TextField, a text primary
key, and two text columns in one name, whose test is an expression) × every collation the
backend can give it (created here where the database needs that) × every fenced write
form. Each cell stores a row under each spelling the collation folds onto the lease's
(checking first that the column's ``=`` really folds it, so no cell passes vacuously),
holds that row's own lock elsewhere, and asserts that the write under the lease is
refused (ValueError: the row is another lock's) and changes nothing; then, as a control,
that the same write form under the row's own lease writes it (the exact comparison must
not refuse an exact name under any collation). Integer columns compare exactly by nature:
:func:`test_an_integer_pin_is_the_name_test_and_a_text_pin_is_not` shows the fast path
still drops their name test.

The test models (tests/testapp/models.py, ``Collated*``) are migrated with the database's
default collation; the ``collated`` fixture gives a column the collation of the cell with
``schema_editor.alter_field`` (SQLite rebuilds the table) and gives every column its
default back when the module ends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.db import connection, models
from django.db.models import F

from distlock import StaleToken, acquire
from distlock.core.leases import Lease
from distlock.models import Lock
from tests.support.helpers import run_async
from tests.testapp.models import (
    Account,
    CollatedChar,
    CollatedPair,
    CollatedResource,
    CollatedSlug,
    CollatedText,
)

pytestmark = pytest.mark.usefixtures("lock_db")

VENDOR = connection.vendor

#: The name's text as the lease spells it, and the spellings a collation may fold onto it.
BASE = "abé"
VARIANTS = {
    "case": "ABé",
    "accent": "abe",
    "pad": "abé ",
    "decomposed": "abe\u0301",
    "width": "\uff41bé",  # FULLWIDTH LATIN SMALL LETTER A
    "punctuation": "ab-é",
}


@dataclass(frozen=True)
class Collation:
    """A collation of the matrix: its SQL name (None: the database's default) and the
    VARIANTS its ``=`` folds onto BASE (checked on the column before each cell)."""

    label: str
    name: str | None
    folds: tuple[str, ...]


# PostgreSQL: nondeterministic ICU collations, created in the test database first
# (:data:`PG_CREATE`). A deterministic collation compares bytes to break ties: the control.
PG_CREATE = {
    # Case-insensitive (ICU strength 2).
    "distlock_ci": "und-u-ks-level2",
    # Case- and accent-insensitive (strength 1).
    "distlock_ai": "und-u-ks-level1",
    # Strength 3, but nondeterministic: canonically equivalent strings are equal.
    "distlock_canonical": "und",
    # Punctuation and spaces ignorable (alternate=shifted).
    "distlock_shifted": "und-u-ka-shifted",
}
COLLATIONS = {
    "postgresql": [
        Collation("default", None, ()),
        Collation("icu-ci", "distlock_ci", ("case", "decomposed", "width")),
        Collation("icu-ai", "distlock_ai", ("case", "accent", "decomposed", "width")),
        Collation("icu-canonical", "distlock_canonical", ("decomposed",)),
        Collation("icu-shifted", "distlock_shifted", ("pad", "decomposed", "punctuation")),
    ],
    "mysql": [
        Collation("general_ci", "utf8mb4_general_ci", ("case", "accent", "pad")),
        Collation("unicode_ci", "utf8mb4_unicode_ci",
                  ("case", "accent", "pad", "decomposed", "width")),
        Collation("bin-pad-space", "utf8mb4_bin", ("pad",)),
        Collation("general_nopad_ci", "utf8mb4_general_nopad_ci", ("case", "accent")),
        Collation("uca1400_as_ci", "utf8mb4_uca1400_as_ci",
                  ("case", "pad", "decomposed", "width")),
        Collation("uca1400_ai_cs", "utf8mb4_uca1400_ai_cs", ("accent", "pad", "decomposed")),
        Collation("uca1400_nopad_as_cs", "utf8mb4_uca1400_nopad_as_cs", ("decomposed",)),
        Collation("nopad_bin", "utf8mb4_nopad_bin", ()),
    ],
    "sqlite": [
        Collation("nocase", "NOCASE", ("case",)),
        Collation("rtrim", "RTRIM", ("pad",)),
        Collation("binary", "BINARY", ()),
    ],
}[VENDOR]


@dataclass(frozen=True)
class Column:
    """A template column type of the matrix: the model, the field the lock name reads
    (the other fields of a two-field name are fixed), and whether that field is unique
    (then a filter on it pins one row)."""

    label: str
    model: type[models.Model]
    field: str
    prefix: str
    suffix: str = ""
    fixed: tuple[tuple[str, str], ...] = ()

    def lock(self, key: str) -> str:
        """The lock name of the row whose field holds ``key``."""
        return f"{self.prefix}{key}{self.suffix}"

    def values(self, key: str) -> dict[str, Any]:
        """The fields of the row whose lock name is ``lock(key)``."""
        return {self.field: key, **dict(self.fixed)}

    @property
    def is_pk(self) -> bool:
        return self.field == self.model._meta.pk.name


COLUMNS = [
    Column("char", CollatedChar, "key", "char:"),
    Column("slug", CollatedSlug, "key", "slug:"),
    Column("text", CollatedText, "key", "text:"),
    Column("text-pk", CollatedResource, "name", "resource:"),
    Column("two-text", CollatedPair, "left", "pair:", "/r", (("right", "r"),)),
]


# -- the write forms ------------------------------------------------------------------------
# Each writes the row ``row`` (as loaded) under ``lease`` with the lease's own spelling of
# the name, ``key``, in whatever the form filters or assigns; it sets ``value`` to 100 (or
# deletes the row). A sync form returns None, an async one its coroutine.

Form = Callable[[Column, models.Model, str, Lease], Awaitable[Any] | None]


def _instance(column: Column, row: models.Model, key: str) -> models.Model:
    """A new instance of ``row`` (same pk) carrying the lease's spelling of the name."""
    fields = {**column.values(key), "value": 100}
    if not column.is_pk:
        fields["pk"] = row.pk
    return column.model(**fields)


def _loaded(column: Column, row: models.Model, key: str) -> models.Model:
    """``row`` loaded from the database, with the lease's spelling assigned to the name's
    field (for a text primary key: the instance now names that pk)."""
    instance = column.model._base_manager.get(pk=row.pk)
    setattr(instance, column.field, key)
    instance.value = 100
    return instance


def _by_name(column: Column, key: str) -> models.QuerySet[Any]:
    """The rows whose name fields equal the lease's spelling, by the column's ``=`` (a pin
    when the field is unique)."""
    return column.model._default_manager.filter(**column.values(key))


def save_force_update(column: Column, row: models.Model, key: str, lease: Lease) -> None:
    _instance(column, row, key).save(fence=lease, force_update=True)


def save_update_fields(column: Column, row: models.Model, key: str, lease: Lease) -> None:
    _instance(column, row, key).save(
        fence=lease, update_fields=["value"]
    )


def save_loaded(column: Column, row: models.Model, key: str, lease: Lease) -> None:
    _loaded(column, row, key).save(fence=lease)


def fenced_update_by_name(column: Column, row: models.Model, key: str, lease: Lease) -> None:
    _by_name(column, key).fenced_update(lease, value=F("value") + 100)


def fenced_update_by_name_and_more(
    column: Column, row: models.Model, key: str, lease: Lease,
) -> None:
    _by_name(column, key).filter(value__gte=0).fenced_update(
        lease, value=F("value") + 100
    )


def fenced_update_by_pk(column: Column, row: models.Model, key: str, lease: Lease) -> None:
    column.model._default_manager.filter(pk=row.pk).fenced_update(
        lease, value=100
    )


def fenced_update_renaming(column: Column, row: models.Model, key: str, lease: Lease) -> None:
    column.model._default_manager.filter(pk=row.pk).fenced_update(
        lease, value=100, **column.values(key)
    )


def fenced_update_unpinned(column: Column, row: models.Model, key: str, lease: Lease) -> None:
    column.model._default_manager.filter(value__gte=0).fenced_update(
        lease, value=100
    )


def fenced_delete_by_name(column: Column, row: models.Model, key: str, lease: Lease) -> None:
    _by_name(column, key).fenced_delete(lease)


def delete_instance(column: Column, row: models.Model, key: str, lease: Lease) -> None:
    _instance(column, row, key).delete(fence=lease)


def asave_force_update(column: Column, row: models.Model, key: str, lease: Lease) -> Any:
    return _instance(column, row, key).asave(fence=lease, force_update=True)


def adelete_instance(column: Column, row: models.Model, key: str, lease: Lease) -> Any:
    return _instance(column, row, key).adelete(fence=lease)


def afenced_update_by_name(column: Column, row: models.Model, key: str, lease: Lease) -> Any:
    return _by_name(column, key).afenced_update(lease, value=100)


def afenced_delete_by_name(column: Column, row: models.Model, key: str, lease: Lease) -> Any:
    return _by_name(column, key).afenced_delete(lease)


FORMS: dict[str, Form] = {
    form.__name__: form for form in [
        save_force_update, save_update_fields, save_loaded, fenced_update_by_name,
        fenced_update_by_name_and_more, fenced_update_by_pk, fenced_update_renaming,
        fenced_update_unpinned, fenced_delete_by_name, delete_instance, asave_force_update,
        adelete_instance, afenced_update_by_name, afenced_delete_by_name,
    ]
}
DELETES = {"fenced_delete_by_name", "delete_instance", "adelete_instance",
           "afenced_delete_by_name"}


def run(form: Form, column: Column, row: models.Model, key: str, lease: Lease) -> None:
    """Run one write form (an async one in an event loop of its own)."""
    result = form(column, row, key, lease)
    if result is not None:
        run_async(lambda: result)


# -- the collation of a column --------------------------------------------------------------


class Collated:
    """Gives a test model's name field a collation, keeping the table's current one, so
    consecutive cells of one (column, collation) alter nothing."""

    def __init__(self) -> None:
        self.current: dict[type[models.Model], models.Field[Any, Any]] = {}
        self.created = False

    def use(self, column: Column, collation: Collation) -> None:
        """Make ``column``'s field have ``collation`` in the database."""
        model = column.model
        original = model._meta.get_field(column.field)
        old = self.current.get(model, original)
        if old.db_collation == collation.name:
            return
        if VENDOR == "postgresql" and not self.created:
            with connection.cursor() as cursor:
                for name, locale in PG_CREATE.items():
                    cursor.execute(
                        f"CREATE COLLATION IF NOT EXISTS {name} "
                        f"(provider = icu, locale = '{locale}', deterministic = false)"
                    )
            self.created = True
        new = self._with_collation(model, original, collation.name)
        with connection.schema_editor() as editor:
            if VENDOR == "postgresql":
                # The migration's varchar_pattern_ops index (for LIKE) refuses a
                # nondeterministic collation; the matrix needs no LIKE.
                editor.execute(f"DROP INDEX IF EXISTS {self._like_index(editor, old)}")
            editor.alter_field(model, old, new)
        self.current[model] = new

    def restore(self) -> None:
        """Every altered field back to the collation of its migration (and on
        PostgreSQL its LIKE index)."""
        for model, altered in list(self.current.items()):
            original = model._meta.get_field(altered.name)
            with connection.schema_editor() as editor:
                editor.alter_field(model, altered, original)
                if VENDOR == "postgresql":
                    like = editor._create_like_index_sql(model, original)
                    if like is not None:
                        editor.execute(like)
            del self.current[model]

    @staticmethod
    def _like_index(editor: Any, field: Any) -> str:
        """The name Django's PostgreSQL schema editor gives ``field``'s LIKE index."""
        return str(editor._create_index_name(field.model._meta.db_table, [field.column],
                                             suffix="_like"))

    @staticmethod
    def _with_collation(
        model: type[models.Model], field: Any, collation: str | None,
    ) -> models.Field[Any, Any]:
        name, path, args, kwargs = field.deconstruct()
        kwargs["db_collation"] = collation
        new: models.Field[Any, Any] = type(field)(*args, **kwargs)
        new.set_attributes_from_name(name)
        new.model = model
        return new


@pytest.fixture(scope="module")
def collated(django_db_setup: None, django_db_blocker: Any) -> Iterator[Collated]:
    """The module's :class:`Collated`; every column gets its default back at the end."""
    state = Collated()
    yield state
    with django_db_blocker.unblock():
        state.restore()


# -- the matrix -----------------------------------------------------------------------------


def snapshot(model: type[models.Model]) -> list[tuple[Any, ...]]:
    """Every row as stored (names, value, fence_token), to show that nothing changed."""
    return sorted(model._base_manager.values_list(), key=repr)


def refusal(
    column: Column, collation: Collation, form_name: str, kind: str,
) -> str | None:
    """One cell: under the lease of lock ``<prefix>abé``, the write form meets only the row
    stored under the ``kind`` spelling, whose own lock another holder holds. None if the
    write was refused (ValueError: another lock's row) and changed nothing; else what
    went wrong."""
    model, stored = column.model, VARIANTS[kind]
    row = model._base_manager.create(**column.values(stored))
    cell = f"{form_name}, row stored as {stored!r} ({kind})"
    # Not vacuous: the column's own '=' finds the row by the lease's spelling.
    if not _by_name(column, BASE).exists():
        model._base_manager.all().delete()
        return f"{cell}: {collation.name} does not fold it onto {BASE!r}"
    before = snapshot(model)
    other = acquire(column.lock(stored), ttl=30, holder="the row's own holder")
    lease = acquire(column.lock(BASE), ttl=30)
    try:
        try:
            run(FORMS[form_name], column, row, BASE, lease)
        except (ValueError, StaleToken) as exc:
            error: Exception | None = exc
        else:
            error = None
        after = snapshot(model)
        if after != before:
            return f"{cell}: wrote it under lease {lease.name!r}: {before} -> {after}"
        if error is None or isinstance(error, StaleToken):
            return f"{cell}: not refused as another lock's row (ValueError): {error!r}"
        if Lock.objects.get(name=other.name).owner != other.owner:
            return f"{cell}: the row's own lock changed hands"
        return None
    finally:
        lease.release()
        other.release()
        model._base_manager.all().delete()


def control(column: Column, form_name: str) -> str | None:
    """The row stored as ``abé`` and its own lease: the write form writes it (the exact
    comparison refuses no exact name under any collation). None, or what went wrong."""
    model = column.model
    row = model._base_manager.create(**column.values(BASE))
    lease = acquire(column.lock(BASE), ttl=30)
    try:
        run(FORMS[form_name], column, row, BASE, lease)
        rows = model._base_manager.filter(**column.values(BASE))
        if form_name in DELETES:
            written = not rows.exists()
        else:
            written = list(rows.values_list(column.field, "value", "fence_token")) == [
                (BASE, 100, lease.token)
            ]
        return None if written else f"{form_name}: the row's own lease did not write it"
    except (ValueError, StaleToken) as exc:
        return f"{form_name}: the row's own lease was refused: {exc!r}"
    finally:
        lease.release()
        model._base_manager.all().delete()


@pytest.mark.parametrize("collation", COLLATIONS, ids=[c.label for c in COLLATIONS])
@pytest.mark.parametrize("column", COLUMNS, ids=[c.label for c in COLUMNS])
def test_a_fenced_write_changes_only_rows_named_exactly_as_its_lock(
    collated: Collated, column: Column, collation: Collation,
) -> None:
    """Every write form (:data:`FORMS`) × every spelling the column's collation folds onto
    ``abé``: refused, nothing changed; and every form writes the row of its own lease.

    One test per (column type, collation), the cells in it: each test costs a flush of
    every table, and the list of failed cells says more than the first failure.
    """
    collated.use(column, collation)
    failed = [
        problem for form_name in FORMS for kind in collation.folds
        if (problem := refusal(column, collation, form_name, kind)) is not None
    ]
    failed += [
        problem for form_name in FORMS if (problem := control(column, form_name)) is not None
    ]
    assert not failed, (
        f"{len(failed)} cells of {column.label} × {collation.label} failed:\n"
        + "\n".join(failed)
    )


# -- the cost of the exact comparison ----------------------------------------------------------


def test_an_integer_pin_is_the_name_test_and_a_text_pin_is_not(collated: Collated) -> None:
    """The one-statement fast path: ``filter(pk=42)`` under lock ``account:42`` needs no
    second test of ``id`` (an integer compares exactly), ``filter(key="abé")`` under lock
    ``char:abé`` does (the column's collation may fold). Both write their row."""
    from django.test.utils import CaptureQueriesContext

    account = Account.objects.create()
    CollatedChar.objects.create(key=BASE)
    account_lease = acquire(f"account:{account.pk}", ttl=30)
    char_lease = acquire(f"char:{BASE}", ttl=30)
    with CaptureQueriesContext(connection) as queries:
        assert Account.objects.filter(pk=account.pk).fenced_update(account_lease, balance=1)
        assert CollatedChar.objects.filter(key=BASE).fenced_update(char_lease, value=1) == 1
    updates = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    assert len(updates) == 2, queries.captured_queries
    account_where = updates[0].split("WHERE", 1)[1]
    char_where = updates[1].split("WHERE", 1)[1]
    id_column = connection.ops.quote_name("id")
    key_column = connection.ops.quote_name("key")
    assert account_where.count(id_column) == 1, account_where
    # The filter's own test and the name test's exact one (and where the backend adds
    # it, the name test's equality its index serves).
    assert char_where.count(key_column) >= 2, char_where


def test_the_name_test_of_an_unpinned_write_can_use_the_column_index(
    collated: Collated,
) -> None:
    """The exact comparison rides along an equality the column's index serves, so a
    fenced write that does not pin its row still finds it through the index (PostgreSQL
    with sequential scans off: the plan shows an index; SQLite: a SEARCH; MariaDB: the
    ``key`` index, for a name in ASCII: see ``MySQL.name_equals_sql``)."""
    from distlock.fencing.conditions import name_test

    CollatedChar.objects.bulk_create(CollatedChar(key=f"k{i}") for i in range(50))
    condition = name_test(CollatedChar, "char:k7", required=True).q
    rows = CollatedChar.objects.filter(condition)
    if VENDOR == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET enable_seqscan = off")
            try:
                plan = rows.explain()
            finally:
                cursor.execute("RESET enable_seqscan")
        assert "Index" in plan and "Seq Scan" not in plan, plan
    elif VENDOR == "sqlite":
        plan = rows.explain()
        assert "SEARCH" in plan and "INDEX" in plan, plan
    else:
        plan = rows.explain()
        index = connection.introspection.get_constraints(
            connection.cursor(), CollatedChar._meta.db_table
        )
        unique = next(name for name, c in index.items() if c["unique"] and c["columns"] == ["key"])
        assert unique in plan, plan
