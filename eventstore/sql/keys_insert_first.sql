-- The first key, minted with a boot claim: inserted only while the table is empty. Two nodes'
-- claims presented at once are serialised by the transaction-scoped advisory lock taken before
-- this statement (keys_lock.sql), so exactly one first key is ever minted by a claim.
INSERT INTO api_keys (key_id, label, scope, agents, salt, digest)
SELECT %(id)s, %(label)s, %(scope)s, %(agents)s, %(salt)s, %(digest)s
 WHERE NOT EXISTS (SELECT 1 FROM api_keys)
RETURNING key_id, label, scope, agents, salt, digest, created_at, last_used_at, revoked_at
