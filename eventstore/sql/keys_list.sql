SELECT key_id, label, scope, agents, salt, digest, created_at, last_used_at, revoked_at
  FROM api_keys
 ORDER BY created_at, key_id
