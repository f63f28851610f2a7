-- A key's last use, coalesced by the caller (at most once a minute per key and node); never
-- moved backwards by a node whose write arrives late.
UPDATE api_keys SET last_used_at = greatest(last_used_at, %(at)s)
 WHERE key_id = %(id)s
