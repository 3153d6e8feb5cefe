-- Cost and drift per node and day (issue 15). The same tables and rules as
-- migrations/sqlite/0005_node_days.sql, in PostgreSQL's own types; the conventions of
-- 0001_init.sql hold.
--
-- The replica holding a node's socket adds to the node's row of the current UTC day at each
-- heartbeat: the seconds it was connected since the previous one (a silent gap is not
-- uptime), its GPUs, and what its engine's own token counters grew by. GET
-- /admin/reports/cost turns the seconds into GPU hours and money, GET /admin/reports/drift
-- sets the counters beside what the ledger billed for the node's work that day.

CREATE TABLE node_days (
    -- Not a foreign key: a node deleted or re-created keeps its history.
    node_id                  TEXT   COLLATE "C" NOT NULL,
    -- The UTC day.
    day                      DATE   NOT NULL,
    -- The model the node served (its first, when it served several).
    model                    TEXT   COLLATE "C" NOT NULL,
    connected_seconds        BIGINT NOT NULL DEFAULT 0 CHECK (connected_seconds >= 0),
    -- GPUs as the node last registered them that day.
    gpus                     INT    NOT NULL DEFAULT 0 CHECK (gpus >= 0),
    engine_prompt_tokens     BIGINT NOT NULL DEFAULT 0 CHECK (engine_prompt_tokens >= 0),
    engine_generation_tokens BIGINT NOT NULL DEFAULT 0 CHECK (engine_generation_tokens >= 0),
    -- Whether any heartbeat of the day carried the engine's counters.
    engine_counters          BOOLEAN NOT NULL DEFAULT FALSE,
    PRIMARY KEY (node_id, day, model)
);
CREATE INDEX node_days_day ON node_days (day);

-- The node whose attempt's usage a settle billed; NULL for rows settled before this
-- migration and for rows no node is known for.
ALTER TABLE usage_ledger ADD COLUMN node_id TEXT COLLATE "C";

-- The pool a node's GPU hours are priced in (`[costs.pools]`); NULL: "unassigned".
ALTER TABLE nodes ADD COLUMN pool TEXT
    CHECK (pool ~ '^[a-z0-9-]{1,63}$');
