-- Bounded billing and the drift report (issue 10), and generation outputs that keep any
-- text. The same columns and rules as migrations/sqlite/0003_usage_bounds.sql, in
-- PostgreSQL's own types; the conventions of 0001_init.sql hold.
--
-- A node's usage report is a claim. A reservation now stores the most its request may bill
-- (the gateway's own prompt count plus a margin; the output ceiling within the context), and
-- a settle bills the claim clamped to those bounds in the one statement that claims the row
-- (src/store/postgres/mod.rs). A clamped claim is kept beside the bill and the row is marked
-- for review; GET /admin/reports/drift lists such rows.

ALTER TABLE usage_ledger
    -- The most the row may bill (`UsageBounds`); NULL for rows admitted before this
    -- migration, which are unbounded.
    ADD COLUMN prompt_token_bound        BIGINT CHECK (prompt_token_bound >= 0),
    ADD COLUMN completion_token_bound    BIGINT CHECK (completion_token_bound >= 0),
    -- The node's report when it exceeded a bound, NULL otherwise. A count beyond BIGINT is
    -- kept as 9223372036854775807 (the claim was at least that).
    ADD COLUMN claimed_prompt_tokens     BIGINT CHECK (claimed_prompt_tokens >= 0),
    ADD COLUMN claimed_completion_tokens BIGINT CHECK (claimed_completion_tokens >= 0),
    -- Why an operator should look at the row (`ReviewReason::as_str`); NULL for most rows.
    ADD COLUMN review                    TEXT CHECK (review IN
                                         ('usage_over_bound', 'usage_unrepresentable',
                                          'unverified_node')),
    -- Bounds come as a pair, and the database itself refuses a bill beyond them.
    ADD CONSTRAINT usage_ledger_bounds_paired
        CHECK ((prompt_token_bound IS NULL) = (completion_token_bound IS NULL)),
    ADD CONSTRAINT usage_ledger_billed_within_bounds
        CHECK ((prompt_token_bound IS NULL OR prompt_tokens <= prompt_token_bound)
               AND (completion_token_bound IS NULL
                    OR completion_tokens <= completion_token_bound)),
    -- A claim is kept whole, only for a row under review; only a settled row has either.
    ADD CONSTRAINT usage_ledger_claims_paired
        CHECK ((claimed_prompt_tokens IS NULL) = (claimed_completion_tokens IS NULL)),
    ADD CONSTRAINT usage_ledger_claim_under_review
        CHECK (claimed_prompt_tokens IS NULL OR review IS NOT NULL),
    ADD CONSTRAINT usage_ledger_review_when_settled
        CHECK (review IS NULL OR status = 'settled');

-- The drift report over a time range: reviewed rows newest first (a few among many, so the
-- partial index stays small), and the settled rows it totals per model. Ranges are on
-- settled_at, the moment the tokens were billed.
CREATE INDEX usage_ledger_reviewed ON usage_ledger (settled_at, id) WHERE review IS NOT NULL;
CREATE INDEX usage_ledger_settled ON usage_ledger (settled_at) WHERE status = 'settled';

-- TEXT cannot hold NUL, which a node's output may contain: the output is kept as the bytes of
-- its UTF-8 instead (the store encodes and decodes it), so a replay returns what streamed.
ALTER TABLE generations ALTER COLUMN output TYPE BYTEA USING convert_to(output, 'UTF8');
