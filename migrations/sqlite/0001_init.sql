-- Switchyard's embedded schema (SQLite): configuration (teams, keys, nodes) and the ledger.
--
-- Conventions, relied on by src/store/sqlite.rs:
-- * Timestamps are INTEGER milliseconds since the Unix epoch, UTC: they sort and compare as
--   numbers, with no time-zone or text-format ambiguity. Read them with
--   `datetime(col / 1000, 'unixepoch')`.
-- * Money is INTEGER microcredits and token counts are INTEGER, never REAL.
-- * JSON columns are TEXT holding valid JSON.
-- * Tables are STRICT, so a value of the wrong type is refused instead of stored. This also
--   catches integer overflow, which SQLite would otherwise turn into a REAL silently.
-- * Ids are AUTOINCREMENT: an id is never reused, so a revoked key's id can stay in caches.

CREATE TABLE teams (
    id                   INTEGER PRIMARY KEY AUTOINCREMENT,
    name                 TEXT    NOT NULL UNIQUE,
    -- Credits minus settled costs; may go negative when a request costs more than its
    -- reservation estimated.
    balance_microcredits INTEGER NOT NULL DEFAULT 0,
    created_at           INTEGER NOT NULL
) STRICT;

-- Append-only history of credits (and corrections, as negative amounts); with the settled
-- ledger rows it explains every balance: balance = sum(credits) - sum(settled cost).
CREATE TABLE credit_entries (
    id                  INTEGER PRIMARY KEY AUTOINCREMENT,
    team_id             INTEGER NOT NULL REFERENCES teams (id),
    amount_microcredits INTEGER NOT NULL,
    note                TEXT    NOT NULL DEFAULT '',
    created_at          INTEGER NOT NULL
) STRICT;

CREATE INDEX credit_entries_team ON credit_entries (team_id, created_at);

CREATE TABLE api_keys (
    id                   INTEGER PRIMARY KEY AUTOINCREMENT,
    team_id              INTEGER NOT NULL REFERENCES teams (id),
    -- Hex SHA-256 of the key; the plaintext is shown once and never stored.
    hash                 TEXT    NOT NULL UNIQUE,
    -- The key's first characters, to recognise it in listings.
    prefix               TEXT    NOT NULL,
    -- JSON array of model names; NULL allows every model.
    model_allowlist      TEXT CHECK (model_allowlist IS NULL OR json_valid(model_allowlist)),
    -- Limits; NULL means the configured default or none.
    rpm                  INTEGER CHECK (rpm >= 0),
    tokens_per_day       INTEGER CHECK (tokens_per_day >= 0),
    max_streams          INTEGER CHECK (max_streams >= 0),
    expires_at           INTEGER,
    revoked_at           INTEGER,
    message_quota        INTEGER CHECK (message_quota >= 0),
    burst_capacity       INTEGER CHECK (burst_capacity >= 0),
    burst_refill_seconds INTEGER CHECK (burst_refill_seconds >= 0),
    created_at           INTEGER NOT NULL
) STRICT;

CREATE INDEX api_keys_team ON api_keys (team_id);

-- One row per request: reserved at admission, then settled or cancelled exactly once.
CREATE TABLE usage_ledger (
    id                          INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id                  TEXT    NOT NULL UNIQUE,
    team_id                     INTEGER NOT NULL REFERENCES teams (id),
    -- NULL for callers authenticated by JWT rather than an API key.
    key_id                      INTEGER REFERENCES api_keys (id),
    -- The resolved model version, never an alias.
    model                       TEXT    NOT NULL,
    -- Exact usage and its cost at the row's prices; zero until settled.
    prompt_tokens               INTEGER NOT NULL DEFAULT 0 CHECK (prompt_tokens >= 0),
    completion_tokens           INTEGER NOT NULL DEFAULT 0 CHECK (completion_tokens >= 0),
    cost_microcredits           INTEGER NOT NULL DEFAULT 0 CHECK (cost_microcredits >= 0),
    -- What the reservation holds against the balance while the row is open.
    estimated_cost_microcredits INTEGER NOT NULL CHECK (estimated_cost_microcredits >= 0),
    -- The model's prices at admission, microcredits per million tokens: a settle prices the
    -- row with these, so a usage report resent after a restart costs what was admitted.
    price_input_per_mtok        INTEGER NOT NULL CHECK (price_input_per_mtok >= 0),
    price_output_per_mtok       INTEGER NOT NULL CHECK (price_output_per_mtok >= 0),
    status                      TEXT    NOT NULL DEFAULT 'reserved'
                                CHECK (status IN ('reserved', 'settled', 'cancelled')),
    created_at                  INTEGER NOT NULL,
    -- When the row became final (settled or cancelled); NULL exactly while reserved.
    settled_at                  INTEGER,
    CHECK ((status = 'reserved') = (settled_at IS NULL))
) STRICT;

-- Open reservations (the balance check, the sweeper) and usage reports by time.
CREATE INDEX usage_ledger_status_created ON usage_ledger (status, created_at);
CREATE INDEX usage_ledger_team_created ON usage_ledger (team_id, created_at);

-- Registration, drain and revocation only; heartbeats live in the coordinator.
CREATE TABLE nodes (
    id              TEXT    PRIMARY KEY,
    location        TEXT    NOT NULL CHECK (location IN ('onprem', 'cloud')),
    -- As last registered: JSON array of GPUs, JSON array of model names.
    gpus            TEXT    NOT NULL DEFAULT '[]' CHECK (json_valid(gpus)),
    models          TEXT    NOT NULL DEFAULT '[]' CHECK (json_valid(models)),
    -- Hex SHA-256 of the node token; NULL once revoked.
    token_hash      TEXT    UNIQUE,
    -- Time of the last registration (not of heartbeats).
    last_seen       INTEGER,
    -- The replica that accepted the last registration.
    orchestrator_id TEXT,
    drained_at      INTEGER,
    created_at      INTEGER NOT NULL
) STRICT;
