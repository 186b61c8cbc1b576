"""The wire cursor: distlock's few PostgreSQL statements sent through libpq directly.

psycopg's cursor does a lot of Python work per ``execute`` that a lock operation does not
need: it parses the query for placeholders, picks a dumper per parameter, keeps its
cache of prepared statements, builds a result description and a row maker. For a lock
operation of one short statement over a Unix socket that work was most of the client's
CPU: the two statements of an acquire and a release cost 110 µs through a psycopg cursor
and about 45 µs through the libpq connection psycopg wraps (``Connection.pgconn``), which
the ``benchmarks/profile_cycle.py`` and ``benchmarks/floor.py`` figures show.

So :class:`WireCursor` prepares each of distlock's statements once per database session,
under a name derived from its text, and runs it with ``PGconn.send_query_prepared``.
Waiting for the result is psycopg's own: ``Connection.wait`` on psycopg's ``execute``
generator (its C version where psycopg-binary or psycopg-c is installed), so the socket
is flushed and waited on as for any psycopg query, notifications reach the connection's
handlers (``notifies()``), and Ctrl-C cancels the statement on the server. Errors are
psycopg's exception classes (``psycopg.errors.error_from_result``), raised inside
Django's ``wrap_database_errors``, so callers see what Django's cursor would raise.

Parameters are sent as text: ``str`` as type "unknown" (the server infers it, as with
psycopg's own ``str`` dumper) in the session's ``client_encoding``; ``int`` as ``bigint``,
``bool`` as ``boolean``, None as NULL; other types are refused (distlock passes no
others). Columns are read with the connection's own psycopg loaders, so values are what
psycopg's cursor would return. Django connects in UTF-8, but code may ``SET
client_encoding`` on the session later; psycopg follows that, and so does this cursor
(it reads the session's encoding before each statement): a name sent in the wrong
encoding would be another lock's name.

A session that lost the prepared statements (``DEALLOCATE ALL``, ``DISCARD ALL``, a
PgBouncer that moved the client) answers "prepared statement does not exist": they are
prepared again and the statement is run again, which is safe because it failed before it
ran and is its own transaction. With ``DISTLOCK_PREPARE_STATEMENTS = False`` this cursor
is not used (a PgBouncer older than 1.21 cannot keep prepared statements).
"""

from __future__ import annotations

import codecs
import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any

from distlock.backends.lean_cursor import ReadAtOnce

# "prepared statement … does not exist" (26000) and "… already exists" (42P05).
LOST_PREPARED_SQLSTATES = {"26000", "42P05"}
_PLACEHOLDER = re.compile(r"%[s%]")
# Parameter type oids: 0 lets the server infer the type (psycopg sends str that way).
_UNKNOWN, _BOOL, _INT8 = 0, 16, 20


class Statement:
    """One of distlock's statements: its name on the server, its text with ``$n``
    placeholders, the parameter types of its first call, and its column loaders once a
    result has been read."""

    __slots__ = ("loaders", "name", "text", "types")

    def __init__(self, sql: str, params: Sequence[Any]) -> None:
        numbers = iter(range(1, len(params) + 1))
        text = _PLACEHOLDER.sub(
            lambda match: "%" if match.group() == "%%" else f"${next(numbers)}", sql
        )
        self.text = text.encode()
        # The text decides the name: two processes, or PgBouncer's server connections,
        # that prepared the same name prepared the same statement.
        self.name = b"distlock_" + hashlib.blake2s(self.text, digest_size=8).hexdigest().encode()
        self.types = [_oid(value) for value in params]
        self.loaders: list[Callable[[bytes], Any]] | None = None


def _oid(value: Any) -> int:
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return _INT8
    if value is None or isinstance(value, str):
        return _UNKNOWN
    raise TypeError(f"distlock's wire cursor cannot send a {type(value).__name__}")


# Each parameter as text, by its exact type (a lookup, not a chain of isinstance: these
# run for every parameter of every lock operation).
_DUMPERS: dict[type, Callable[[Any], bytes | None]] = {
    str: str.encode,
    int: lambda value: b"%d" % value,
    bool: lambda value: b"t" if value else b"f",
    type(None): lambda value: None,
}


def _dumpers(codec: str) -> dict[type, Callable[[Any], bytes | None]]:
    """:data:`_DUMPERS` for a session whose client encoding is Python's ``codec``."""
    if codecs.lookup(codec).name == "utf-8":
        return _DUMPERS
    return {**_DUMPERS, str: lambda value: value.encode(codec)}


def _text(value: Any, dumpers: dict[type, Callable[[Any], bytes | None]]) -> bytes | None:
    dump = dumpers.get(type(value))
    if dump is None:
        # A subclass (a name given as Django's SafeString, a token as an IntEnum).
        base = next((kind for kind in (bool, int, str) if isinstance(value, kind)), None)
        if base is None:
            raise TypeError(f"distlock's wire cursor cannot send a {type(value).__name__}")
        dump = dumpers[base]
    return dump(value)


class WireCursor(ReadAtOnce):
    """Runs distlock's statements on a psycopg 3 connection's libpq session (see the
    module's docstring). One per database session, like every lean cursor."""

    def open(self, raw: Any) -> Any:
        from psycopg import errors, generators, pq

        self.pgconn = raw.pgconn
        self.client_encoding: bytes | None = None
        self.encoding = "utf-8"
        self.dumpers = _DUMPERS
        self.statements: dict[str, Statement] = {}
        self.prepared: set[bytes] = set()
        self.rows: list[tuple[Any, ...]] = []
        self.count = -1
        self._execute = generators.execute
        self._error = errors.error_from_result
        self._tuples_ok = pq.ExecStatus.TUPLES_OK
        self._command_ok = pq.ExecStatus.COMMAND_OK
        self._text_format = pq.Format.TEXT
        return None

    def execute(self, sql: str, params: Any = None) -> None:
        params = params or ()
        with self.db.wrap_database_errors:
            if self.pgconn.parameter_status(b"client_encoding") != self.client_encoding:
                self._follow_encoding()
            statement = self.statements.get(sql)
            if statement is None:
                statement = self.statements[sql] = Statement(sql, params)
            values = [_text(value, self.dumpers) for value in params]
            with self.raw.lock:
                result = self._run(statement, values)
                if result is None:
                    # Lost behind our back: prepare them again, and run it once more.
                    self.prepared.clear()
                    result = self._run(statement, values, again=True)
            self._read(statement, result)

    def _follow_encoding(self) -> None:
        """Send and read text in the session's client encoding, as psycopg does."""
        self.client_encoding = self.pgconn.parameter_status(b"client_encoding")
        self.encoding = self.raw.info.encoding
        self.dumpers = _dumpers(self.encoding)
        for statement in self.statements.values():
            statement.loaders = None  # psycopg's text loaders decode in the old encoding

    def _run(self, statement: Statement, values: list[bytes | None], again: bool = False) -> Any:
        """The statement's result, or None if the session had lost it (first try only)."""
        if statement.name not in self.prepared:
            self._prepare(statement)
        self.pgconn.send_query_prepared(statement.name, values)
        result = self._result()
        if result.status == self._tuples_ok or result.status == self._command_ok:
            return result
        error = self._error(result, self.encoding)
        if again or error.sqlstate not in LOST_PREPARED_SQLSTATES:
            raise error
        return None

    def _prepare(self, statement: Statement) -> None:
        self.pgconn.send_prepare(statement.name, statement.text, statement.types)
        result = self._result()
        if result.status != self._command_ok:
            error = self._error(result, self.encoding)
            # 42P05: the session has it already (prepared before this cursor was made).
            if error.sqlstate != "42P05":
                raise error
        self.prepared.add(statement.name)

    def _result(self) -> Any:
        """The last result of the statement just sent (an error's, if one failed)."""
        results = self.raw.wait(self._execute(self.pgconn))
        if not results:
            # No answer at all: the session is gone (psycopg's error, as its cursor's).
            from psycopg import OperationalError

            raise OperationalError(f"the connection is lost: {self.pgconn.error_message!r}")
        return results[-1]

    def _read(self, statement: Statement, result: Any) -> None:
        loaders = statement.loaders
        if loaders is None:
            loaders = statement.loaders = [
                self._loader(result.ftype(column)) for column in range(result.nfields)
            ]
        value = result.get_value
        self.rows = [
            tuple([
                None if (data := value(row, column)) is None else load(data)
                for column, load in enumerate(loaders)
            ])
            for row in range(result.ntuples)
        ]
        tuples = result.command_tuples
        self.count = -1 if tuples is None else tuples

    def _loader(self, oid: int) -> Callable[[bytes], Any]:
        """psycopg's loader of type ``oid`` on this connection: a type it does not know
        (void, say) is read as text, as psycopg's cursor reads it."""
        adapters = self.raw.adapters
        loader = adapters.get_loader(oid, self._text_format)
        if loader is None:
            loader = adapters.get_loader(_UNKNOWN, self._text_format)
        return loader(oid, self.raw).load  # type: ignore[no-any-return]

