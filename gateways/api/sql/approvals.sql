-- An agent's tool calls waiting for approval, oldest first.
SELECT approval_id, agent_id, session_key, turn_id, call_id, slug, mutating, reason,
       requested_at, expires_at
  FROM approvals
 WHERE agent_id = %(agent)s AND status = 'pending'
 ORDER BY requested_at, approval_id
 LIMIT 500
