-- The service tiers a key may use (comma-separated tier names) and its own tier; NULL takes
-- the configured defaults (`[service_tiers] key_tiers`, `key_default`).
ALTER TABLE api_keys ADD COLUMN service_tiers TEXT;
ALTER TABLE api_keys ADD COLUMN service_tier TEXT;
