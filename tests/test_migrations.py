"""distlock's migrations: back to zero and forwards again, and the pre-release series.

0001_initial makes the tables; 0002_postgresql_functions makes PostgreSQL's server-side
functions (nothing elsewhere). 0002 replaces the pre-release steps 0003–0007, so a
database those migrated counts as migrated without running anything. 0003_token_floor
makes the token floor, started at the table's largest token, and redefines
distlock_acquire on PostgreSQL to start new rows above it. 0005 indexes the owned lock
rows, each vendor in its own form. 0006 makes the stored procedures of the lock
operations on MariaDB/MySQL (nothing elsewhere). 0007 makes PostgreSQL's waiter queue
and hand-off, 0008 indexes the rare audit event kinds, 0009 makes the chain PostgreSQL's
waiters wait in (nothing elsewhere), 0011 lets the first few of them listen instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder

from distlock import acquire
from distlock.constants import (
    EVENT_TABLE,
    FLOOR_TABLE,
    LOCK_TABLE,
    OWNED_INDEX,
    RARE_EVENTS_INDEX,
)
from distlock.models import Lock, TokenFloor

pytestmark = pytest.mark.usefixtures("lock_db")

# Each server-side function of 0002 (and 0007, 0009, 0011) and its argument types, as
# pg_proc lists them.
POSTGRESQL_FUNCTIONS = {
    "distlock_acquire": "text, text, text, bigint, bigint",
    "distlock_ahead": "text, bigint",
    "distlock_channel": "text",
    "distlock_enqueue": "text, boolean, bigint, integer",
    "distlock_follow": "text, bigint, integer",
    "distlock_holds": "text, text, bigint",
    "distlock_leave": "text, bigint",
    "distlock_listen": "text",
    "distlock_queue": "text, boolean",
    "distlock_release": "text, text, bigint, boolean",
    "distlock_renew": "text, text, bigint, bigint",
    "distlock_unlisten": "text",
    "distlock_unqueue": "text",
    "distlock_wake": "text",
}
# The waiter queue's (0007 and 0009): gone when migrated back to 0002.
QUEUE_FUNCTIONS = {"distlock_ahead", "distlock_enqueue", "distlock_follow", "distlock_leave",
                   "distlock_queue", "distlock_unqueue"}
PRE_RELEASE = [
    "0003_postgresql_functions",
    "0004_lockevent",
    "0005_postgresql_wakeups",
    "0006_postgresql_release_commit",
    "0007_postgresql_fence_check",
]


LATEST = ("distlock", "0012_postgresql_queue_cleanup")


def tables() -> set[str]:
    return {LOCK_TABLE, EVENT_TABLE, FLOOR_TABLE} & set(connection.introspection.table_names())


def functions() -> dict[str, str]:
    """distlock's functions on PostgreSQL (every overload), empty elsewhere.

    Trigger functions are left out: RefuseLowerFenceToken's comes with a fenced model's
    migration (tests/testapp's here), not with distlock's.
    """
    if connection.vendor != "postgresql":
        return {}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT proname, oidvectortypes(proargtypes) FROM pg_proc"
            " WHERE proname LIKE 'distlock\\_%%' AND prorettype <> 'trigger'::regtype"
            " ORDER BY 1, 2"
        )
        found: dict[str, str] = {}
        for name, arguments in cursor.fetchall():
            assert name not in found, f"{name} is defined twice: {found[name]} / {arguments}"
            found[name] = arguments
        return found


@pytest.fixture
def migrated_back() -> Iterator[None]:
    """Whatever a test migrates distlock back to, it ends migrated to the end."""
    try:
        yield
    finally:
        call_command("migrate", "distlock", verbosity=0)


def test_migrations_run_back_to_zero_and_forwards_again(migrated_back: None) -> None:
    expected = POSTGRESQL_FUNCTIONS if connection.vendor == "postgresql" else {}
    assert tables() == {LOCK_TABLE, EVENT_TABLE, FLOOR_TABLE}
    assert functions() == expected
    call_command("migrate", "distlock", "0002", verbosity=0)
    assert tables() == {LOCK_TABLE, EVENT_TABLE}
    assert functions() == {
        name: args for name, args in expected.items() if name not in QUEUE_FUNCTIONS
    }, "0007's or 0009's queue functions outlived their reversal"
    call_command("migrate", "distlock", "0001", verbosity=0)
    assert tables() == {LOCK_TABLE, EVENT_TABLE}
    assert functions() == {}
    call_command("migrate", "distlock", "zero", verbosity=0)
    assert tables() == set()
    call_command("migrate", "distlock", verbosity=0)
    assert tables() == {LOCK_TABLE, EVENT_TABLE, FLOOR_TABLE}
    assert functions() == expected
    lease = acquire("migrated", ttl=30)
    assert lease.release() is True


def acquire_source() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT prosrc FROM pg_proc WHERE proname = 'distlock_acquire'")
        return str(cursor.fetchone()[0])


def release_source() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT prosrc FROM pg_proc WHERE proname = 'distlock_release'")
        return str(cursor.fetchone()[0])


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's functions")
def test_0010_reversed_puts_back_the_bodies_it_replaced(migrated_back: None) -> None:
    from distlock.migrations._postgresql import ACQUIRE_0007, RELEASE_0002

    def body(sql: str) -> str:
        return sql.split("$$", 2)[1]

    assert "(0010)" in acquire_source() and "(0010)" in release_source()
    call_command("migrate", "distlock", "0007", verbosity=0)
    assert acquire_source() == body(ACQUIRE_0007)
    assert release_source() == body(RELEASE_0002)
    call_command("migrate", "distlock", verbosity=0)
    assert "(0010)" in acquire_source() and "(0010)" in release_source()
    lease = acquire("migrated-0010", ttl=30)
    assert lease.release() is True


def queue_sources() -> dict[str, tuple[str, str]]:
    """The queue functions 0009 and 0011 define: name -> (argument types, body)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT proname, oidvectortypes(proargtypes), prosrc FROM pg_proc WHERE proname "
            "IN ('distlock_ahead', 'distlock_enqueue', 'distlock_follow', 'distlock_leave')"
        )
        return {name: (args, source) for name, args, source in cursor.fetchall()}


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's functions")
def test_0011_reversed_puts_back_0009s_chain(migrated_back: None) -> None:
    """Reversed, 0011 leaves 0009's four functions, byte for byte, and no overload; a
    waiter of 0009's (three arguments) is served by 0011's with 0009's rule."""
    from distlock.migrations._postgresql import CHAIN_0009

    chain = CHAIN_0009.split("$$")[1::2]
    assert all("(0011)" not in body for body in chain)
    assert [name for name, (_, source) in queue_sources().items()
            if "(0011)" in source] == ["distlock_enqueue"]
    call_command("migrate", "distlock", "0010", verbosity=0)
    assert sorted(source for _, source in queue_sources().values()) == sorted(chain)
    assert functions()["distlock_enqueue"] == "text, boolean, bigint"
    call_command("migrate", "distlock", verbosity=0)
    assert functions() == POSTGRESQL_FUNCTIONS
    with connection.cursor() as cursor:
        cursor.execute("SELECT queued, head FROM distlock_enqueue('old-client', true, 0)")
        queued, head = cursor.fetchone()
        assert head is True
        cursor.execute("SELECT distlock_leave('old-client', %s)", [queued])
    lease = acquire("migrated-0011", ttl=30)
    assert lease.release() is True


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's functions")
def test_0012_reversed_puts_back_0011s_queue_and_forwards_cleans_up(migrated_back: None) -> None:
    """Reversed, 0012 leaves 0011's distlock_enqueue and 0009's distlock_follow and
    distlock_leave, byte for byte; forwards, its three bodies are the ones in use."""
    from importlib import import_module

    cleanup = import_module("distlock.migrations.0012_postgresql_queue_cleanup")
    queue = ("distlock_enqueue", "distlock_follow", "distlock_leave")
    call_command("migrate", "distlock", "0011", verbosity=0)
    assert sorted(queue_sources()[name][1] for name in queue) == sorted(
        cleanup.BACKWARDS.split("$$")[1::2])
    call_command("migrate", "distlock", verbosity=0)
    assert sorted(queue_sources()[name][1] for name in queue) == sorted(
        cleanup.FUNCTIONS.split("$$")[1::2])
    assert functions() == POSTGRESQL_FUNCTIONS


def test_token_floor_starts_at_the_largest_token_of_an_existing_table(
    migrated_back: None,
) -> None:
    """A database from before 0003 keeps its promise: a name purged before the migration
    (its tokens at most the table's largest) comes back above all of them."""
    call_command("migrate", "distlock", "0002", verbosity=0)
    if connection.vendor == "postgresql":
        assert "distlock_floor" not in acquire_source()
    Lock.objects.create(name="kept-low", token=7, owner="", expires_us=0)
    Lock.objects.create(name="kept-top", token=41, owner="", expires_us=0)
    call_command("migrate", "distlock", verbosity=0)
    assert TokenFloor.objects.get().token == 41
    if connection.vendor == "postgresql":
        assert "distlock_floor" in acquire_source()
    lease = acquire("purged-before-0003", ttl=30)
    assert lease.token == 42
    assert lease.release() is True


@pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="PostgreSQL only: fillfactor is its option"
)
def test_postgresql_lock_table_fillfactor_goes_with_the_functions(migrated_back: None) -> None:
    def options() -> list[str] | None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT reloptions FROM pg_class WHERE relname = %s", [LOCK_TABLE])
            return cursor.fetchone()[0]

    assert options() == ["fillfactor=70"]
    call_command("migrate", "distlock", "0001", verbosity=0)
    assert options() is None
    call_command("migrate", "distlock", verbosity=0)
    assert options() == ["fillfactor=70"]


def owned_index() -> dict[str, object] | None:
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, LOCK_TABLE)
    return found.get(OWNED_INDEX)


def test_owned_rows_index_comes_and_goes_with_0005(migrated_back: None) -> None:
    """PostgreSQL and SQLite: a partial index on name; MariaDB: an index on owner."""
    columns = ["owner"] if connection.vendor == "mysql" else ["name"]
    assert owned_index() is not None and owned_index()["columns"] == columns
    call_command("migrate", "distlock", "0004", verbosity=0)
    assert owned_index() is None
    call_command("migrate", "distlock", verbosity=0)
    assert owned_index() is not None and owned_index()["columns"] == columns


def rare_events_index() -> dict[str, object] | None:
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, EVENT_TABLE)
    return found.get(RARE_EVENTS_INDEX)


def test_rare_events_index_comes_and_goes_with_0008(migrated_back: None) -> None:
    """(kind, at_us): partial (the rare kinds) on PostgreSQL and SQLite, full on MariaDB."""
    assert rare_events_index() is not None
    assert rare_events_index()["columns"] == ["kind", "at_us"]
    call_command("migrate", "distlock", "0007", verbosity=0)
    assert rare_events_index() is None
    call_command("migrate", "distlock", verbosity=0)
    assert rare_events_index() is not None


def test_the_rare_kinds_are_event_kinds() -> None:
    from distlock.constants import RARE_KINDS
    from distlock.models import LockEvent

    assert set(RARE_KINDS) == set(LockEvent.Kind.values) - {"acquired", "renewed", "released"}


def test_a_database_the_pre_release_series_migrated_counts_as_migrated() -> None:
    """The records a pre-release leaves (0001 and 0003–0007, no 0002) mean 0002 is applied."""
    recorder = MigrationRecorder(connection)
    squashed = ("distlock", "0002_postgresql_functions")
    pre_release = [("distlock", name) for name in PRE_RELEASE]
    applied = recorder.applied_migrations()
    assert squashed in applied
    # Applying 0002 records the names it replaces too: add only what is missing.
    added = [key for key in pre_release if key not in applied]
    try:
        recorder.record_unapplied(*squashed)
        for key in added:
            recorder.record_applied(*key)
        loader = MigrationLoader(connection)
        assert loader.replacements[squashed].replaces == pre_release
        assert squashed in loader.applied_migrations
        assert set(loader.graph.leaf_nodes("distlock")) == {LATEST}
        call_command("migrate", "distlock", verbosity=0)  # records 0002, runs nothing
        assert squashed in recorder.applied_migrations()
    finally:
        for key in added:
            recorder.record_unapplied(*key)
        if squashed not in recorder.applied_migrations():
            recorder.record_applied(*squashed)


def procedures() -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT ROUTINE_NAME FROM information_schema.ROUTINES "
            "WHERE ROUTINE_SCHEMA = DATABASE() AND ROUTINE_NAME LIKE 'distlock%%'"
        )
        return {str(name) for (name,) in cursor.fetchall()}


@pytest.mark.skipif(
    "connection.vendor != 'mysql'", reason="MariaDB/MySQL only: stored procedures of 0006"
)
def test_mysql_procedures_come_and_go_with_0006(migrated_back: None) -> None:
    from distlock.backends.mysql_procedures import PROCEDURES

    assert procedures() == set(PROCEDURES)
    call_command("migrate", "distlock", "0005", verbosity=0)
    assert procedures() == set()
    call_command("migrate", "distlock", verbosity=0)
    assert procedures() == set(PROCEDURES)
    # Installing over procedures that exist replaces them (DROP … IF EXISTS first).
    from distlock.backends.mysql import MySQL

    with connection.schema_editor(atomic=False) as editor:
        MySQL().install_procedures(editor, True)
    assert procedures() == set(PROCEDURES)
    lease = acquire("procedures", ttl=30)
    lease.renew(ttl=30)
    assert Lock.objects.get(name="procedures").renew_count == 1
    assert lease.release() is True
