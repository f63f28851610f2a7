-- Soft revoke: the first revocation's time is kept (a second DELETE answers the same record).
UPDATE api_keys SET revoked_at = coalesce(revoked_at, now())
 WHERE key_id = %(id)s
RETURNING key_id, label, scope, agents, salt, digest, created_at, last_used_at, revoked_at
