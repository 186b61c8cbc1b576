"""MariaDB/MySQL: the stored procedures of migration 0003 (see distlock/backends/mysql.py).

Kept apart from mysql.py only for its length. Each procedure runs the portable steps of
:mod:`distlock.backends.base` in a transaction of its own and answers with one row.
Owners are VARBINARY: they compare byte for byte, whatever the owner column's collation.
Each error handler rolls back the procedure's own transaction and raises the error again
with its code (RESIGNAL); a missing row is the NOT FOUND condition of SELECT … INTO.
"""

from __future__ import annotations

from distlock.constants import FLOOR_ID, FLOOR_TABLE, LOCK_TABLE

# SYSDATE() is real time; NOW() is fixed at statement start. UNIX_TIMESTAMP reads its
# argument in the session time zone, which is also SYSDATE's, so the pair is exact.
NOW_US = "CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED)"

_DECLARE = """
    DECLARE v_found INT DEFAULT 1;
    DECLARE v_token, v_expires, v_now, v_top BIGINT;
    DECLARE v_owner VARBINARY(32);
    DECLARE v_holder VARCHAR(255) CHARACTER SET utf8mb4;
    DECLARE CONTINUE HANDLER FOR NOT FOUND SET v_found = 0;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION BEGIN ROLLBACK; RESIGNAL; END;"""
_LOCK_ROW = f"""
        SELECT token, owner, holder, expires_us INTO v_token, v_owner, v_holder, v_expires
          FROM {LOCK_TABLE} WHERE name = p_name FOR UPDATE;"""

_ACQUIRE = f"""
CREATE PROCEDURE distlock_acquire(
    IN p_name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {{collation}},
    IN p_owner VARBINARY(32), IN p_holder VARCHAR(255) CHARACTER SET utf8mb4,
    IN p_ttl_us BIGINT, IN p_max_token BIGINT)
MODIFIES SQL DATA SQL SECURITY INVOKER
BEGIN{_DECLARE}
    attempt: LOOP
        SET v_found = 1;
        START TRANSACTION;{_LOCK_ROW}
        IF v_found THEN
            -- The clock is read only now that the row lock is held.
            SET v_now = {NOW_US};
            IF v_token >= p_max_token THEN
                ROLLBACK;
                SELECT 'exhausted', v_token, NULL, NULL, '', NULL;
            ELSEIF v_owner <> '' AND v_expires > v_now THEN
                COMMIT;
                SELECT 'busy', v_token, NULL, NULL, v_holder, v_expires - v_now;
            ELSE
                UPDATE {LOCK_TABLE} SET token = v_token + 1, owner = p_owner,
                       holder = p_holder, acquired_us = v_now, renewed_us = NULL,
                       expires_us = v_now + p_ttl_us, renew_count = 0
                 WHERE name = p_name;
                COMMIT;
                SELECT 'granted', v_token + 1, v_now, v_now + p_ttl_us,
                       IF(v_owner <> '', v_holder, ''), NULL;
            END IF;
            LEAVE attempt;
        END IF;
        -- First use of the name, in a transaction of its own: the locking read of a
        -- missing key may take a gap lock, and inserting under it deadlocks with another
        -- first user. The new row starts one above the token floor, read under a share
        -- lock held to the commit (see Backend.acquire_new).
        COMMIT;
        START TRANSACTION;
        SET v_found = 1;
        SELECT token INTO v_top FROM {FLOOR_TABLE} WHERE id = {FLOOR_ID} LOCK IN SHARE MODE;
        IF NOT v_found THEN
            INSERT IGNORE INTO {FLOOR_TABLE} (id, token)
            VALUES ({FLOOR_ID}, (SELECT COALESCE(MAX(token), 0) FROM {LOCK_TABLE}));
            SELECT token INTO v_top FROM {FLOOR_TABLE} WHERE id = {FLOOR_ID} LOCK IN SHARE MODE;
        END IF;
        IF v_top >= p_max_token THEN
            ROLLBACK;
            SELECT 'exhausted_table', v_top, NULL, NULL, '', NULL;
            LEAVE attempt;
        END IF;
        SET v_now = {NOW_US};
        INSERT IGNORE INTO {LOCK_TABLE}
               (name, token, owner, holder, acquired_us, renewed_us, expires_us, renew_count)
        VALUES (p_name, v_top + 1, p_owner, p_holder, v_now, NULL, v_now + p_ttl_us, 0);
        IF ROW_COUNT() = 1 THEN
            COMMIT;
            SELECT 'granted', v_top + 1, v_now, v_now + p_ttl_us, '', NULL;
            LEAVE attempt;
        END IF;
        -- Another session created the row first: go round, it exists now.
        COMMIT;
    END LOOP;
END"""

_RENEW = f"""
CREATE PROCEDURE distlock_renew(
    IN p_name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {{collation}},
    IN p_owner VARBINARY(32), IN p_token BIGINT, IN p_ttl_us BIGINT)
MODIFIES SQL DATA SQL SECURITY INVOKER
BEGIN{_DECLARE}
    START TRANSACTION;{_LOCK_ROW.replace("        ", "    ")}
    SET v_now = {NOW_US};
    IF NOT v_found THEN
        COMMIT;
        SELECT 'missing', NULL, NULL;
    ELSEIF v_owner <> p_owner OR v_token <> p_token THEN
        COMMIT;
        SELECT 'changed', NULL, NULL;
    ELSEIF v_expires <= v_now THEN
        COMMIT;
        SELECT 'expired', NULL, NULL;
    ELSE
        UPDATE {LOCK_TABLE} SET renewed_us = v_now, expires_us = v_now + p_ttl_us,
               renew_count = renew_count + 1
         WHERE name = p_name;
        COMMIT;
        SELECT 'renewed', v_now, v_now + p_ttl_us;
    END IF;
END"""

_RELEASE = f"""
CREATE PROCEDURE distlock_release(
    IN p_name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE {{collation}},
    IN p_owner VARBINARY(32), IN p_token BIGINT)
MODIFIES SQL DATA SQL SECURITY INVOKER
BEGIN{_DECLARE}
    START TRANSACTION;{_LOCK_ROW.replace("        ", "    ")}
    IF NOT v_found OR v_owner <> p_owner OR v_token <> p_token THEN
        COMMIT;
        SELECT 0, NULL;
    ELSE
        SET v_now = {NOW_US};
        UPDATE {LOCK_TABLE} SET owner = '', holder = '', expires_us = v_now
         WHERE name = p_name;
        COMMIT;
        SELECT v_expires > v_now, v_now;
    END IF;
END"""

PROCEDURES = ("distlock_acquire", "distlock_renew", "distlock_release")
DROP = tuple(f"DROP PROCEDURE IF EXISTS {name}" for name in PROCEDURES)


def procedures_sql(collation: str) -> list[str]:
    """The statements that (re)create the procedures. ``collation`` is the lock table's
    name column's: a parameter of another collation could not use its primary key."""
    if not collation.replace("_", "").isalnum():
        raise ValueError(f"not a collation name: {collation!r}")
    return [*DROP, *(sql.format(collation=collation) for sql in (_ACQUIRE, _RENEW, _RELEASE))]

