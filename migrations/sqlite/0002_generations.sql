-- The Generations API's state (SPEC sections 5 and 9): one row per (principal,
-- Idempotency-Key), the principal's message counters per fixed window, and a row per
-- principal holding its burst bucket. Same conventions as 0001_init.sql: INTEGER
-- milliseconds, STRICT tables. Every change to these rows is decided by the pure rules in
-- `switchyard_actors::lifecycle` (`apply`, `admission::decide`); the store only loads,
-- calls them and writes back, inside one write transaction.

-- One logical generation. It holds no prompt: a fingerprint of the request's semantic
-- inputs, and the output while it is retained. Enums are their `as_str()` names.
CREATE TABLE generations (
    id               TEXT    PRIMARY KEY,
    -- The principal (API key or JWT subject) that owns it.
    subject          TEXT    NOT NULL,
    idempotency_key  TEXT    NOT NULL,
    -- SHA-256 of the normalized request.
    fingerprint      TEXT    NOT NULL,
    -- The model version resolved at admission, never an alias.
    model            TEXT    NOT NULL,
    status           TEXT    NOT NULL CHECK (status IN
                     ('queued', 'running', 'completed', 'cancelled', 'failed', 'rejected')),
    cancel_requested INTEGER NOT NULL CHECK (cancel_requested IN (0, 1)),
    -- The current attempt epoch (0 before the first dispatch).
    attempt          INTEGER NOT NULL CHECK (attempt >= 0),
    attempt_state    TEXT    NOT NULL CHECK (attempt_state IN
                     ('none', 'dispatched', 'accepted', 'refused', 'fenced')),
    -- The message reservation, and the window it belongs to forever.
    message          TEXT    NOT NULL CHECK (message IN ('reserved', 'consumed', 'released')),
    window_start_ms  INTEGER NOT NULL,
    -- The concurrency slot and its bound (after it the sweeper expires the generation).
    slot_held        INTEGER NOT NULL CHECK (slot_held IN (0, 1)),
    slot_expires_ms  INTEGER NOT NULL,
    input_tokens     INTEGER NOT NULL CHECK (input_tokens >= 0),
    output_tokens    INTEGER NOT NULL CHECK (output_tokens >= 0),
    -- The output text while retained; NULL before the end and after the retention.
    output           TEXT,
    error_code       TEXT,
    created_ms       INTEGER NOT NULL,
    -- When it ended (or was rejected); NULL while active.
    terminal_ms      INTEGER,
    -- The current admission's ledger row (the id, or id#suffix after a readmission).
    ledger_id        TEXT    NOT NULL,
    -- The engine's finish reason (stop, length, abort, …) when the node reported one.
    finish_reason    TEXT,
    UNIQUE (subject, idempotency_key)
) STRICT;

-- Admission counts a principal's held slots whose bound has not passed.
CREATE INDEX generations_held ON generations (subject, slot_expires_ms) WHERE slot_held;
-- The sweeper: active generations past their bound, and outputs past their retention.
CREATE INDEX generations_active_bound ON generations (status, slot_expires_ms);
CREATE INDEX generations_retained ON generations (terminal_ms) WHERE output IS NOT NULL;

-- A principal's messages in one fixed window: `used` were accepted by a node, `reserved`
-- are admitted and not yet consumed or released. Admission needs used + reserved < limit.
CREATE TABLE message_windows (
    subject         TEXT    NOT NULL,
    window_start_ms INTEGER NOT NULL,
    used            INTEGER NOT NULL DEFAULT 0 CHECK (used >= 0),
    reserved        INTEGER NOT NULL DEFAULT 0 CHECK (reserved >= 0),
    PRIMARY KEY (subject, window_start_ms)
) STRICT;

-- One row per principal: its burst bucket (tokens x 1000 as of bucket_at_ms; NULL before
-- its first admission, which starts full). On PostgreSQL it is also the lock that
-- serialises the principal's admissions; SQLite's write lock does that here.
CREATE TABLE generation_principals (
    subject      TEXT    PRIMARY KEY,
    bucket_milli INTEGER,
    bucket_at_ms INTEGER,
    CHECK ((bucket_milli IS NULL) = (bucket_at_ms IS NULL))
) STRICT;
