-- One key by its id (the id is embedded in the secret, so verifying a secret reads one row).
SELECT key_id, label, scope, agents, salt, digest, created_at, last_used_at, revoked_at
  FROM api_keys
 WHERE key_id = %(id)s
