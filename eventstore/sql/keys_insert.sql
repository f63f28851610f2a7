INSERT INTO api_keys (key_id, label, scope, agents, salt, digest)
VALUES (%(id)s, %(label)s, %(scope)s, %(agents)s, %(salt)s, %(digest)s)
RETURNING key_id, label, scope, agents, salt, digest, created_at, last_used_at, revoked_at
