"""The search box of the Locks list and of the Lock events list: a lock name prefix,
found through an index that starts with the name (the lock table's primary key; the
events' ``(name, at_us)``).

Django's ``search_fields`` search is ``icontains`` on every field, a scan of the whole
table (0.9–1.5 s at a million lock rows; at ten million events, the slowest operator
page; docs/performance.md). Names are structured
(``invoice:42``, ``report:customer:2026-12``), so what an operator types is the start of
one. The box's rules (docs/operations.md, and the help text under it):

- ``invoice:4`` finds the names that start with ``invoice:4``, case-sensitive as names
  are; the name itself, if it exists, is the first row (the list is in name order).
- ``=invoice:4`` finds that one name only.
- White space around the term is dropped; an empty term lists everything.

Where the name column orders by code point (SQLite; the binary NO PAD collation distlock
gives the column on MariaDB/MySQL; PostgreSQL under C, POSIX or C.UTF-8), the names
starting with ``p`` are exactly those with ``p <= name < prefix_end(p)``: one range of
the index. Elsewhere (a linguistic PostgreSQL collation) the search is ``LIKE 'p%'``,
right but a scan.

The events are listed newest first, and a prefix many events share is found fastest by
walking ``at_us`` back until a page is full, a rare one through its range of
``(name, at_us)``. PostgreSQL and MariaDB choose by their statistics; SQLite, which has
none to go by, read the whole range and sorted it (17 s for a prefix all ten million
events share). So when the range holds at least ``COMMON`` events (one read of the index
finds out) its bounds are given as the backend's ``common_prefix_sql`` terms, which tell
SQLite they are true of most rows: the page walks ``at_us``, and the list's capped count,
which has no order, still reads the name range (distlock/backends/indexes.py).
"""

from __future__ import annotations

from typing import Any, TypeVar

from django.contrib import admin, messages
from django.db import connections
from django.db.models import BooleanField, QuerySet
from django.db.models.expressions import RawSQL
from django.http import HttpRequest

from distlock.backends import backend_for
from distlock.validation import check_name

_Q = TypeVar("_Q", bound=QuerySet)  # type: ignore[type-arg]

EXACT = "="
# Events a name prefix must have to be read newest first by walking at_us back (module
# docstring): below it, reading the range and sorting it is the cheaper of the two.
COMMON = 20_000
# Code points: the largest, and the surrogates, which no str stored in a database has.
_LAST = 0x10FFFF
_SURROGATES = range(0xD800, 0xE000)

HELP_TEXT = (
    "The start of a lock name, case-sensitive: “invoice:4” finds invoice:4, invoice:42… "
    "(the name itself first). “=invoice:4” finds that name only. A worker's locks: "
    "“Held by” below."
)
EVENTS_HELP_TEXT = (
    "The start of a lock name, case-sensitive: “invoice:4” finds the events of invoice:4, "
    "invoice:42…; “=invoice:4” those of that name only. Holder, owner and who broke a lock "
    "are not searched: narrow by name, kind and age, and read them in the list."
)


class NameSearch:
    """The ``get_search_results`` of a ModelAdmin whose box searches lock names: what
    :func:`search` finds, never with duplicates; a term no name can match (too long, a
    NUL) lists nothing and says why. ``newest_first``: the list is in time order, not
    in name order (the events)."""

    newest_first = False

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        try:
            return search(queryset, search_term, newest_first=self.newest_first), False
        except ValueError as exc:
            model_admin: admin.ModelAdmin[Any] = self  # type: ignore[assignment]
            model_admin.message_user(
                request, f"Nothing was searched: {exc}.", messages.ERROR
            )
            return queryset.none(), False


def check_term(term: str) -> tuple[str, bool]:
    """(the name or prefix, whether it is an exact name) of a search term; ValueError
    with a message for the operator if it cannot start a lock name (too long, a NUL)."""
    term = term.strip()
    exact = term.startswith(EXACT)
    value = term[len(EXACT):].strip() if exact else term
    try:
        return check_name(value), exact
    except ValueError as exc:
        raise ValueError(f"no lock name can match “{_shown(value)}”: "
                         f"{str(exc).replace('lock name', 'it')}") from None


def prefix_end(prefix: str) -> str | None:
    """The smallest string above every string that starts with ``prefix``, in code
    point order (None: there is none, the prefix is all U+10FFFF).

    The last character that is not U+10FFFF, one code point up (over the surrogates),
    with what followed it dropped: a name starting with ``prefix`` is below it, since
    it has a smaller character at that place, and a name at or above ``prefix`` and
    below it starts with ``prefix``.
    """
    kept = prefix.rstrip(chr(_LAST))
    if not kept:
        return None
    up = ord(kept[-1]) + 1
    if up in _SURROGATES:
        up = _SURROGATES.stop
    return kept[:-1] + chr(up)


def search(queryset: _Q, term: str, *, newest_first: bool = False) -> _Q:
    """``queryset`` narrowed to the names ``term`` finds (module docstring); ValueError
    from :func:`check_term` for a term no name can match. ``newest_first``: the rows
    will be read in time order (the events)."""
    if not term.strip():
        return queryset
    value, exact = check_term(term)
    if exact:
        return queryset.filter(name=value)
    connection = connections[queryset.db]
    backend = backend_for(connection)
    if not backend.names_in_code_point_order(connection):
        return queryset.filter(name__startswith=value)
    end = prefix_end(value)
    found = queryset.filter(name__gte=value)
    found = found if end is None else found.filter(name__lt=end)
    hint = backend.common_prefix_sql
    if not newest_first or hint is None or not _common(found):
        return found
    bounds = [(hint[0], value)] + ([] if end is None else [(hint[1], end)])
    for sql, bound in bounds:
        queryset = queryset.filter(RawSQL(sql, [bound], output_field=BooleanField()))
    return queryset


def _common(found: QuerySet[Any]) -> bool:
    """Does the name range ``found`` hold at least COMMON rows? One read of the name
    index, COMMON entries at most."""
    return bool(list(found.order_by().values_list("pk", flat=True)[COMMON - 1:COMMON]))


def _shown(value: str) -> str:
    """A term fit to quote in a message: NULs and lone surrogates visible, at most 60
    characters."""
    shown = value.encode("utf-8", "backslashreplace").decode().replace("\x00", "\\x00")
    return shown if len(shown) <= 60 else f"{shown[:60]}… ({len(value):,} characters)"
