-- Switchyard's production schema (PostgreSQL): configuration (teams, keys, nodes) and the
-- ledger. The same tables, columns and rules as migrations/sqlite/0001_init.sql, in
-- PostgreSQL's own types.
--
-- Conventions, relied on by src/store/postgres.rs:
-- * Timestamps are TIMESTAMPTZ, written by the store from its injected clock (no DEFAULT
--   now(): simulations control time) and truncated to milliseconds, so both backends
--   return the same instants.
-- * Money is BIGINT microcredits and token counts are BIGINT, never NUMERIC or floats;
--   arithmetic that would overflow raises an error and the transaction rolls back.
-- * Limits that are u32 in Rust are BIGINT too: INTEGER would refuse values above 2^31.
-- * Lists of names are TEXT[] (order kept, no NULL elements); the GPU description, which is
--   opaque to the server, is JSON, which keeps the agent's text as sent.
-- * Ids are identity columns: a sequence never hands an id out twice, so a revoked key's id
--   can stay in caches.

CREATE TABLE teams (
    id                   BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name                 TEXT        NOT NULL UNIQUE,
    -- Credits minus settled costs; may go negative when a request costs more than its
    -- reservation estimated.
    balance_microcredits BIGINT      NOT NULL DEFAULT 0,
    created_at           TIMESTAMPTZ NOT NULL
);

-- Append-only history of credits (and corrections, as negative amounts); with the settled
-- ledger rows it explains every balance: balance = sum(credits) - sum(settled cost).
CREATE TABLE credit_entries (
    id                  BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    team_id             BIGINT      NOT NULL REFERENCES teams (id),
    amount_microcredits BIGINT      NOT NULL,
    note                TEXT        NOT NULL DEFAULT '',
    created_at          TIMESTAMPTZ NOT NULL
);

CREATE INDEX credit_entries_team ON credit_entries (team_id, created_at);

CREATE TABLE api_keys (
    id                   BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    team_id              BIGINT      NOT NULL REFERENCES teams (id),
    -- Hex SHA-256 of the key; the plaintext is shown once and never stored.
    hash                 TEXT        NOT NULL UNIQUE,
    -- The key's first characters, to recognise it in listings.
    prefix               TEXT        NOT NULL,
    -- Model names; NULL allows every model, an empty array none.
    model_allowlist      TEXT[]      CHECK (array_position(model_allowlist, NULL) IS NULL),
    -- Limits; NULL means the configured default or none.
    rpm                  BIGINT      CHECK (rpm >= 0),
    tokens_per_day       BIGINT      CHECK (tokens_per_day >= 0),
    max_streams          BIGINT      CHECK (max_streams >= 0),
    expires_at           TIMESTAMPTZ,
    revoked_at           TIMESTAMPTZ,
    message_quota        BIGINT      CHECK (message_quota >= 0),
    burst_capacity       BIGINT      CHECK (burst_capacity >= 0),
    burst_refill_seconds BIGINT      CHECK (burst_refill_seconds >= 0),
    created_at           TIMESTAMPTZ NOT NULL
);

CREATE INDEX api_keys_team ON api_keys (team_id);

-- One row per request: reserved at admission, then settled or cancelled exactly once.
CREATE TABLE usage_ledger (
    id                          BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_id                  TEXT        NOT NULL UNIQUE,
    team_id                     BIGINT      NOT NULL REFERENCES teams (id),
    -- NULL for callers authenticated by JWT rather than an API key.
    key_id                      BIGINT      REFERENCES api_keys (id),
    -- The resolved model version, never an alias.
    model                       TEXT        NOT NULL,
    -- Exact usage and its cost at the row's prices; zero until settled.
    prompt_tokens               BIGINT      NOT NULL DEFAULT 0 CHECK (prompt_tokens >= 0),
    completion_tokens           BIGINT      NOT NULL DEFAULT 0 CHECK (completion_tokens >= 0),
    cost_microcredits           BIGINT      NOT NULL DEFAULT 0 CHECK (cost_microcredits >= 0),
    -- What the reservation holds against the balance while the row is open.
    estimated_cost_microcredits BIGINT      NOT NULL CHECK (estimated_cost_microcredits >= 0),
    -- The model's prices at admission, microcredits per million tokens: a settle prices the
    -- row with these, so a usage report resent after a restart costs what was admitted.
    price_input_per_mtok        BIGINT      NOT NULL CHECK (price_input_per_mtok >= 0),
    price_output_per_mtok       BIGINT      NOT NULL CHECK (price_output_per_mtok >= 0),
    status                      TEXT        NOT NULL DEFAULT 'reserved'
                                CHECK (status IN ('reserved', 'settled', 'cancelled')),
    created_at                  TIMESTAMPTZ NOT NULL,
    -- When the row became final (settled or cancelled); NULL exactly while reserved.
    settled_at                  TIMESTAMPTZ,
    CHECK ((status = 'reserved') = (settled_at IS NULL))
);

-- Open reservations by age (the sweeper) and usage reports by time.
CREATE INDEX usage_ledger_status_created ON usage_ledger (status, created_at);
CREATE INDEX usage_ledger_team_created ON usage_ledger (team_id, created_at);
-- The admission check sums a team's open estimates under the team's row lock; this partial
-- index holds only open rows, so the sum stays an index-only scan of a handful of entries
-- however long the team's history grows.
CREATE INDEX usage_ledger_team_open ON usage_ledger (team_id)
    INCLUDE (estimated_cost_microcredits) WHERE status = 'reserved';

-- Registration, drain and revocation only; heartbeats live in the coordinator.
CREATE TABLE nodes (
    -- Byte order ("C"), as SQLite compares text: listings sort the same on both backends
    -- whatever the database's locale.
    id              TEXT        COLLATE "C" PRIMARY KEY,
    location        TEXT        NOT NULL CHECK (location IN ('onprem', 'cloud')),
    -- As last registered: the GPUs (a JSON document) and the model names.
    gpus            JSON        NOT NULL DEFAULT '[]',
    models          TEXT[]      NOT NULL DEFAULT '{}'
                                CHECK (array_position(models, NULL) IS NULL),
    -- Hex SHA-256 of the node token; NULL once revoked.
    token_hash      TEXT        UNIQUE,
    -- Time of the last registration (not of heartbeats).
    last_seen       TIMESTAMPTZ,
    -- The replica that accepted the last registration.
    orchestrator_id TEXT,
    drained_at      TIMESTAMPTZ,
    created_at      TIMESTAMPTZ NOT NULL
);
