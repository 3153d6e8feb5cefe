-- Bounded billing and the drift report (issue 10). The same columns and rules as
-- migrations/postgres/0003_usage_bounds.sql; the conventions of 0001_init.sql hold.
--
-- A node's usage report is a claim. A reservation now stores the most its request may bill
-- (the gateway's own prompt count plus a margin; the output ceiling within the context), and
-- a settle bills the claim clamped to those bounds in the one statement that claims the row
-- (src/store/sqlite/mod.rs). A clamped claim is kept beside the bill and the row is marked
-- for review; GET /admin/reports/drift lists such rows.
--
-- SQLite adds a column at a time, and a column's CHECK may name the columns before it, so
-- the rules PostgreSQL states as table constraints ride on the last column they name.
-- Generation outputs need no change here: SQLite's TEXT holds NUL.

-- The most the row may bill (`UsageBounds`); NULL for rows admitted before this migration,
-- which are unbounded. Bounds come as a pair, and the database itself refuses a bill beyond
-- them.
ALTER TABLE usage_ledger ADD COLUMN prompt_token_bound INTEGER
    CHECK (prompt_token_bound IS NULL
           OR (prompt_token_bound >= 0 AND prompt_tokens <= prompt_token_bound));
ALTER TABLE usage_ledger ADD COLUMN completion_token_bound INTEGER
    CHECK ((prompt_token_bound IS NULL) = (completion_token_bound IS NULL)
           AND (completion_token_bound IS NULL
                OR (completion_token_bound >= 0
                    AND completion_tokens <= completion_token_bound)));
-- Why an operator should look at the row (`ReviewReason::as_str`); NULL for most rows. Only
-- a settled row has one.
ALTER TABLE usage_ledger ADD COLUMN review TEXT
    CHECK (review IS NULL
           OR (review IN ('usage_over_bound', 'usage_unrepresentable', 'unverified_node')
               AND status = 'settled'));
-- The node's report when it exceeded a bound, NULL otherwise; kept whole, only for a row
-- under review. A count beyond INTEGER is kept as 9223372036854775807 (the claim was at
-- least that).
ALTER TABLE usage_ledger ADD COLUMN claimed_prompt_tokens INTEGER
    CHECK (claimed_prompt_tokens IS NULL
           OR (claimed_prompt_tokens >= 0 AND review IS NOT NULL));
ALTER TABLE usage_ledger ADD COLUMN claimed_completion_tokens INTEGER
    CHECK ((claimed_prompt_tokens IS NULL) = (claimed_completion_tokens IS NULL)
           AND (claimed_completion_tokens IS NULL OR claimed_completion_tokens >= 0));

-- The drift report over a time range: reviewed rows newest first (a few among many, so the
-- partial index stays small), and the settled rows it totals per model. Ranges are on
-- settled_at, the moment the tokens were billed.
CREATE INDEX usage_ledger_reviewed ON usage_ledger (settled_at, id) WHERE review IS NOT NULL;
CREATE INDEX usage_ledger_settled ON usage_ledger (settled_at) WHERE status = 'settled';
