-- A retained result beside its text (issue 11): the reasoning and tool calls of the answer,
-- as the JSON `Assembled::extra_json` writes (actors/src/output.rs); NULL when the answer had
-- neither, and for rows written before this migration. Expired with `output`.
ALTER TABLE generations ADD COLUMN output_extra TEXT;
