"""The token floor: a new lock row starts above one row, not above the whole table.

Before this migration the first use of a name started its row above
``SELECT MAX(token) FROM distlock_lock`` — a full scan, since ``token`` has no index (an
index would end the heap-only updates every grant relies on), so first uses slowed down
as the table grew (99 ms at a million rows against 0.5 ms empty, on PostgreSQL), and
purge kept the row with the largest token so that the maximum stayed.

Now ``distlock_floor`` holds one row (id 1), which purge raises to the largest token it
deletes in the deleting transaction, and a new row starts at floor + 1. The floor starts
here at the table's largest token, which is at least every token purge ever deleted
(purge always kept a row above them), so an existing database keeps its promise: a
purged name that comes back starts above every token it ever had.

On PostgreSQL ``distlock_acquire`` is redefined with that first-use step; the reverse
puts back 0002's (distlock/migrations/_postgresql.py).
"""

from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

from distlock.migrations._postgresql import ACQUIRE_0002, NOW_US

# 0002's distlock_acquire, but for the first-use branch (marked below).
ACQUIRE = f"""
CREATE OR REPLACE FUNCTION distlock_acquire(
    p_name text, p_owner text, p_holder text, p_ttl_us bigint, p_max_token bigint,
    OUT status text, OUT token bigint, OUT acquired_us bigint, OUT expires_us bigint,
    OUT other text, OUT remaining_us bigint
) LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r distlock_lock%ROWTYPE;
    now_us bigint;
    top bigint;
BEGIN
    LOOP
        -- A look without the row lock: a held lock is refused without writing anything.
        SELECT * INTO r FROM distlock_lock l WHERE l.name = p_name;
        IF FOUND THEN
            now_us := {NOW_US};
            IF r.owner <> '' AND r.expires_us > now_us THEN
                status := 'busy'; token := r.token; other := r.holder;
                remaining_us := r.expires_us - now_us;
                RETURN;
            END IF;
            SELECT * INTO r FROM distlock_lock l WHERE l.name = p_name FOR UPDATE;
            IF FOUND THEN
                -- Read the clock only now that the row lock is held.
                now_us := {NOW_US};
                IF r.token >= p_max_token THEN
                    status := 'exhausted'; token := r.token;
                    RETURN;
                END IF;
                IF r.owner <> '' AND r.expires_us > now_us THEN
                    status := 'busy'; token := r.token; other := r.holder;
                    remaining_us := r.expires_us - now_us;
                    RETURN;
                END IF;
                UPDATE distlock_lock l
                   SET token = r.token + 1, owner = p_owner, holder = p_holder,
                       acquired_us = now_us, renewed_us = NULL,
                       expires_us = now_us + p_ttl_us, renew_count = 0
                 WHERE l.name = p_name;
                status := 'granted'; token := r.token + 1;
                acquired_us := now_us; expires_us := now_us + p_ttl_us;
                other := CASE WHEN r.owner <> '' THEN r.holder ELSE '' END;
                RETURN;
            END IF;
            -- Purged between the two reads: start again.
        ELSE
            -- (0003) First use of the name: start above the token floor, which purge
            -- raises to every token it deletes. The share lock holds to the end of the
            -- statement's transaction, and purge raises the floor under FOR UPDATE: no
            -- purge can delete a fresh row of this name and raise the floor between this
            -- read and the INSERT below, which would then give that row's token again.
            SELECT f.token INTO top FROM distlock_floor f WHERE f.id = 1 FOR SHARE;
            IF NOT FOUND THEN
                -- Emptied by a flush: put back what new rows started above before 0003.
                INSERT INTO distlock_floor AS f (id, token)
                VALUES (1, (SELECT COALESCE(MAX(l.token), 0) FROM distlock_lock l))
                ON CONFLICT (id) DO NOTHING;
                SELECT f.token INTO top FROM distlock_floor f WHERE f.id = 1 FOR SHARE;
            END IF;
            IF top >= p_max_token THEN
                status := 'exhausted_table'; token := top;
                RETURN;
            END IF;
            now_us := {NOW_US};
            INSERT INTO distlock_lock AS l
                   (name, token, owner, holder, acquired_us, renewed_us, expires_us,
                    renew_count)
            VALUES (p_name, top + 1, p_owner, p_holder, now_us, NULL, now_us + p_ttl_us, 0)
            ON CONFLICT (name) DO NOTHING;
            IF FOUND THEN
                status := 'granted'; token := top + 1;
                acquired_us := now_us; expires_us := now_us + p_ttl_us; other := '';
                RETURN;
            END IF;
            -- Another session created the row first: go round, it exists now.
        END IF;
    END LOOP;
END
$$;
"""


def forwards(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    alias = schema_editor.connection.alias
    Lock = apps.get_model("distlock", "Lock")
    TokenFloor = apps.get_model("distlock", "TokenFloor")
    top = Lock.objects.using(alias).aggregate(top=models.Max("token"))["top"] or 0
    TokenFloor.objects.using(alias).update_or_create(id=1, defaults={"token": top})
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(ACQUIRE, params=None)


def backwards(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        # 0002's distlock_acquire, exactly (0003 changes no other function).
        schema_editor.execute(ACQUIRE_0002, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ("distlock", "0002_postgresql_functions"),
    ]

    operations = [
        migrations.CreateModel(
            name="TokenFloor",
            fields=[
                ("id", models.PositiveSmallIntegerField(default=1, editable=False, primary_key=True, serialize=False)),
                ("token", models.BigIntegerField(default=0, editable=False)),
            ],
            options={
                "verbose_name": "token floor",
                "db_table": "distlock_floor",
            },
        ),
        migrations.RunPython(forwards, backwards, elidable=False),
    ]
