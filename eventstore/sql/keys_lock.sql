-- Serialises first-key claims (keys_insert_first.sql) across nodes; released at commit.
SELECT pg_advisory_xact_lock(hashtext('dispach.api_keys.claim'))
