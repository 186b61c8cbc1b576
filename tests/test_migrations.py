"""distlock's migrations: back to zero and forwards again, and the upgrade from 0.2.

0001_tables makes the tables and the vendor indexes, 0002_postgresql_version_1
PostgreSQL's server-side functions (distlock/backends/postgresql_functions.py's version
1; nothing elsewhere), 0003_mysql_procedures MariaDB's stored procedures (nothing
elsewhere). They squash distlock 0.2's twelve migrations: a database those migrated
counts as migrated and nothing runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.db.migrations.loader import MigrationLoader
from django.db.migrations.recorder import MigrationRecorder

from distlock import acquire
from distlock.backends.postgresql_functions import ARGUMENTS_1, FUNCTIONS_1
from distlock.constants import (
    EVENT_TABLE,
    FLOOR_TABLE,
    LOCK_TABLE,
    OWNED_INDEX,
    RARE_EVENTS_INDEX,
    TASK_KEY_TABLE,
)
from distlock.models import Lock, TokenFloor

pytestmark = pytest.mark.usefixtures("lock_db")

LATEST = ("distlock", "0005_floor_timeline")
# Each squashing migration and the 0.2 migrations it replaces.
SQUASHED = {
    "0001_tables": [
        "0001_initial",
        "0003_token_floor",
        "0004_lockevent_name_at_index",
        "0005_lock_owned_index",
        "0008_lockevent_rare_index",
    ],
    "0002_postgresql_version_1": [
        "0002_postgresql_functions",
        "0007_postgresql_handoff",
        "0009_postgresql_waiter_chain",
        "0010_postgresql_fewer_statements",
        "0011_postgresql_first_waiters_listen",
        "0012_postgresql_queue_cleanup",
    ],
    "0003_mysql_procedures": ["0006_mysql_procedures"],
}


def tables() -> set[str]:
    ours = {LOCK_TABLE, EVENT_TABLE, FLOOR_TABLE, TASK_KEY_TABLE}
    return ours & set(connection.introspection.table_names())


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


def sources() -> dict[str, str]:
    """The body of each distlock function, as PostgreSQL keeps it."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT proname, prosrc FROM pg_proc WHERE proname LIKE 'distlock\\_%%'"
                       " AND prorettype <> 'trigger'::regtype")
        return {str(name): str(source) for name, source in cursor.fetchall()}


@pytest.fixture
def migrated_back() -> Iterator[None]:
    """Whatever a test migrates distlock back to, it ends migrated to the end."""
    try:
        yield
    finally:
        call_command("migrate", "distlock", verbosity=0)


def test_migrations_run_back_to_zero_and_forwards_again(migrated_back: None) -> None:
    expected = ARGUMENTS_1 if connection.vendor == "postgresql" else {}
    assert tables() == {LOCK_TABLE, EVENT_TABLE, FLOOR_TABLE, TASK_KEY_TABLE}
    assert functions() == expected
    call_command("migrate", "distlock", "0001", verbosity=0)
    assert tables() == {LOCK_TABLE, EVENT_TABLE, FLOOR_TABLE}
    assert functions() == {}
    call_command("migrate", "distlock", "zero", verbosity=0)
    assert tables() == set()
    call_command("migrate", "distlock", verbosity=0)
    assert tables() == {LOCK_TABLE, EVENT_TABLE, FLOOR_TABLE, TASK_KEY_TABLE}
    assert functions() == expected
    assert TokenFloor.objects.get().token == 0
    lease = acquire("migrated", ttl=30)
    assert lease.token == 1
    assert lease.release() is True


@pytest.mark.skipif("connection.vendor != 'postgresql'", reason="PostgreSQL's functions")
def test_version_1_installs_the_module_s_text_byte_for_byte() -> None:
    """What the database runs is what distlock/backends/postgresql_functions.py shows."""
    assert sources() == {name: sql.split("$$")[1] for name, sql in FUNCTIONS_1.items()}
    assert list(FUNCTIONS_1) == list(ARGUMENTS_1)


@pytest.mark.skipif(
    "connection.vendor != 'postgresql'", reason="PostgreSQL only: fillfactor is its option"
)
def test_postgresql_lock_table_fillfactor_and_queue_go_with_the_functions(
    migrated_back: None,
) -> None:
    def options() -> list[str] | None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT reloptions FROM pg_class WHERE relname = %s", [LOCK_TABLE])
            return cursor.fetchone()[0]

    def columns() -> set[str]:
        with connection.cursor() as cursor:
            found = connection.introspection.get_table_description(cursor, LOCK_TABLE)
        return {column.name for column in found}

    assert options() == ["fillfactor=70"]
    assert {"reserved_pid", "reserved_until_us"} <= columns()
    assert "distlock_waiter" in connection.introspection.table_names()
    call_command("migrate", "distlock", "0001", verbosity=0)
    assert options() is None
    assert not {"reserved_pid", "reserved_until_us"} & columns()
    assert "distlock_waiter" not in connection.introspection.table_names()
    call_command("migrate", "distlock", verbosity=0)
    assert options() == ["fillfactor=70"]


def test_the_vendor_indexes_come_with_0001() -> None:
    """Owned rows: a partial index on name (PostgreSQL, SQLite), one on owner (MariaDB).
    Rare events: (kind, at_us), partial but on MariaDB."""
    with connection.cursor() as cursor:
        on_locks = connection.introspection.get_constraints(cursor, LOCK_TABLE)
        on_events = connection.introspection.get_constraints(cursor, EVENT_TABLE)
    owned = ["owner"] if connection.vendor == "mysql" else ["name"]
    assert on_locks[OWNED_INDEX]["columns"] == owned
    assert on_events[RARE_EVENTS_INDEX]["columns"] == ["kind", "at_us"]
    assert on_events["distlock_event_name_at"]["columns"] == ["name", "at_us"]


def test_the_rare_kinds_are_event_kinds() -> None:
    from distlock.constants import RARE_KINDS
    from distlock.models import LockEvent

    assert set(RARE_KINDS) == set(LockEvent.Kind.values) - {"acquired", "renewed", "released"}


def test_a_database_distlock_0_2_migrated_counts_as_migrated() -> None:
    """The records 0.2's series leaves (its twelve names, none of the squashes) mean every
    squash is applied: migrate records them and runs nothing (a run would fail: the
    tables exist)."""
    recorder = MigrationRecorder(connection)
    squashes = [("distlock", name) for name in SQUASHED]
    old = [("distlock", name) for names in SQUASHED.values() for name in names]
    applied = recorder.applied_migrations()
    # Applying a squash records the names it replaces too.
    assert set(squashes) | set(old) <= set(applied)
    Lock.objects.create(name="kept", token=41, owner="", expires_us=0)
    try:
        for key in squashes:
            recorder.record_unapplied(*key)
        loader = MigrationLoader(connection)
        for key in squashes:
            assert [("distlock", name) for name in SQUASHED[key[1]]] == \
                loader.replacements[key].replaces
            assert key in loader.applied_migrations
        assert set(loader.graph.leaf_nodes("distlock")) == {LATEST}
        call_command("migrate", "distlock", verbosity=0)
        assert set(squashes) <= set(recorder.applied_migrations())
    finally:
        for key in squashes:
            if key not in recorder.applied_migrations():
                recorder.record_applied(*key)
    assert Lock.objects.get(name="kept").token == 41
    assert functions() == (ARGUMENTS_1 if connection.vendor == "postgresql" else {})


def test_a_database_part_way_through_0_2_is_refused_not_half_migrated() -> None:
    """0.2's series applied up to 0009 (not 0010–0012): the squash cannot stand for the
    rest, which are gone, so migrate fails at once and changes nothing. Django's message
    names two leaf nodes; CHANGELOG.md says what to do: finish 0.2's series with
    distlock 0.2 first (never ``makemigrations --merge``)."""
    recorder = MigrationRecorder(connection)
    missing = [("distlock", name) for name in SQUASHED["0002_postgresql_version_1"][3:]]
    squash = ("distlock", "0002_postgresql_version_1")
    before = functions()
    try:
        recorder.record_unapplied(*squash)
        for key in missing:
            recorder.record_unapplied(*key)
        with pytest.raises(CommandError, match=f"0001_tables, {LATEST[1]}"):
            call_command("migrate", "distlock", verbosity=0)
        assert functions() == before
    finally:
        for key in [squash, *missing]:
            recorder.record_applied(*key)


def procedures() -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT ROUTINE_NAME FROM information_schema.ROUTINES "
            "WHERE ROUTINE_SCHEMA = DATABASE() AND ROUTINE_NAME LIKE 'distlock%%'"
        )
        return {str(name) for (name,) in cursor.fetchall()}


@pytest.mark.skipif(
    "connection.vendor != 'mysql'", reason="MariaDB/MySQL only: stored procedures of 0003"
)
def test_mysql_procedures_come_and_go_with_0003(migrated_back: None) -> None:
    from distlock.backends.mysql_procedures import PROCEDURES

    assert procedures() == set(PROCEDURES)
    call_command("migrate", "distlock", "0002", verbosity=0)
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
