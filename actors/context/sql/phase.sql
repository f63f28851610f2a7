-- The phase a session is in, as the sessions projection (inline) holds it: NULL for the entry
-- phase, and no row for a session that has none yet.
SELECT phase FROM sessions WHERE agent_id = %(agent_id)s AND session_key = %(session_key)s
