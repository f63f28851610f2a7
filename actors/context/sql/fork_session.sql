-- Whether a session has a row: it had a turn, a clear or a fork.
SELECT 1 FROM sessions WHERE agent_id = %(agent_id)s AND session_key = %(session_key)s
