"""Fixed facts every other module shares: table and field names, sizes and limits.

Plain values and nothing else, so any module (models, the SQL of the backends, argument
checks, migrations' helpers) can import them without importing anything of distlock.
"""

from __future__ import annotations

# The lock table and the audit history, as created by distlock's migrations.
LOCK_TABLE = "distlock_lock"
# The index of the owned (held or expired) lock rows (Lock.Meta.indexes).
OWNED_INDEX = "distlock_lock_owned"
# The audit events of the kinds that are rare (trouble), and their index (migration 0001):
# "the stale writes" must not walk ten million grants and renewals to find a handful.
RARE_KINDS = ("took_over", "broken", "lost", "stale_write")
RARE_EVENTS_INDEX = "distlock_event_rare"
EVENT_TABLE = "distlock_lockevent"
# The uniqueness keys of enqueue_once() (distlock/integrations/unique.py).
TASK_KEY_TABLE = "distlock_taskkey"
# One row: the largest token of any lock row purge_locks() deleted. A new lock row starts
# above it (see Backend.acquire_new).
FLOOR_TABLE = "distlock_floor"
FLOOR_ID = 1

# Rows purge_locks() and audit retention delete per transaction: each batch holds its row
# locks for a few milliseconds, never for the length of the whole purge.
PURGE_BATCH = 1000
# After each batch of purge_locks() or audit retention that deleted rows, a rest this many
# times as long as the batch took, at most PURGE_REST_MAX seconds, so waiting writers get
# in between batches (distlock/core/batches.py).
PURGE_REST = 1.0
PURGE_REST_MAX = 0.05
# A batch that gave up waiting for SQLite's write lock (its busy timeout, "database is
# locked") is run again, at most this many times, before the purge fails with the error.
PURGE_BUSY_RETRIES = 3
# On SQLite a batch polls for the write lock itself (its busy timeout set to 0 meanwhile),
# every PURGE_POLL seconds on average (jittered), for as long as the busy timeout would
# have waited: SQLite's own busy handler sleeps 1, 2, 5 ... 100 ms between its polls and
# loses the lock to a writer that commits hundreds of times a second.
PURGE_POLL = 0.0005
# After a SQLite batch that found the write lock taken (writers are busy beside it), a
# rest of at least this long: each batch delays one operation of each writer by its own
# length, so fewer batches a second keep the writers' p99 where it was.
PURGE_BUSY_REST = 0.1

# The column every fenced model has: the highest fencing token that wrote the row.
FENCE_FIELD = "fence_token"

# Column sizes of the lock table: a name is its primary key; ``owner`` is a random id of
# 32 hex digits; ``holder`` is a description for people, cut to fit where it is stored.
MAX_NAME_LENGTH = 255
OWNER_LENGTH = 32
HOLDER_LENGTH = 255

# What distlock.leader writes into the holder text of an election's lock: how the admin
# and the leader gauge tell an election's lock from any other (display only: a caller
# who writes it into a plain lock's holder text sees that lock listed as an election).
LEADER_MARK = "[leader]"

# Fencing tokens are signed 64-bit integers on every backend, starting at 1.
MAX_TOKEN = 2**63 - 1

# The shortest lease accepted, in seconds.
MIN_TTL = 0.001
# The longest duration any argument may have, in seconds (about 31,700 years): as
# microseconds it fits a signed 64-bit integer with room for a database time added to it.
MAX_SECONDS = 10**12
