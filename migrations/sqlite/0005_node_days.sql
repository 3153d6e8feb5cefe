-- Cost and drift per node and day (issue 15). The same tables and rules as
-- migrations/postgres/0005_node_days.sql; the conventions of 0001_init.sql hold (a day is
-- TEXT 'YYYY-MM-DD', which sorts and compares as dates do).
--
-- The replica holding a node's socket adds to the node's row of the current UTC day at each
-- heartbeat: the seconds it was connected since the previous one (a silent gap is not
-- uptime), its GPUs, and what its engine's own token counters grew by. GET
-- /admin/reports/cost turns the seconds into GPU hours and money, GET /admin/reports/drift
-- sets the counters beside what the ledger billed for the node's work that day.

CREATE TABLE node_days (
    -- Not a foreign key: a node deleted or re-created keeps its history.
    node_id                  TEXT    NOT NULL,
    -- The UTC day.
    day                      TEXT    NOT NULL CHECK (day GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]'),
    -- The model the node served (its first, when it served several).
    model                    TEXT    NOT NULL,
    connected_seconds        INTEGER NOT NULL DEFAULT 0 CHECK (connected_seconds >= 0),
    -- GPUs as the node last registered them that day.
    gpus                     INTEGER NOT NULL DEFAULT 0 CHECK (gpus >= 0),
    engine_prompt_tokens     INTEGER NOT NULL DEFAULT 0 CHECK (engine_prompt_tokens >= 0),
    engine_generation_tokens INTEGER NOT NULL DEFAULT 0 CHECK (engine_generation_tokens >= 0),
    -- Whether any heartbeat of the day carried the engine's counters (0 or 1).
    engine_counters          INTEGER NOT NULL DEFAULT 0 CHECK (engine_counters IN (0, 1)),
    PRIMARY KEY (node_id, day, model)
) STRICT;
CREATE INDEX node_days_day ON node_days (day);

-- The node whose attempt's usage a settle billed; NULL for rows settled before this
-- migration and for rows no node is known for.
ALTER TABLE usage_ledger ADD COLUMN node_id TEXT;

-- The pool a node's GPU hours are priced in (`[costs.pools]`); NULL: "unassigned".
ALTER TABLE nodes ADD COLUMN pool TEXT
    CHECK (pool IS NULL OR (length(pool) BETWEEN 1 AND 63 AND pool NOT GLOB '*[^a-z0-9-]*'));
