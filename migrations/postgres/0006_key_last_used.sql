-- When each key last admitted a request (the operator's console lists it beside the key): the
-- newest ledger row of a key is one index look-up, whatever the team's history holds.
CREATE INDEX usage_ledger_key_created ON usage_ledger (key_id, created_at);
