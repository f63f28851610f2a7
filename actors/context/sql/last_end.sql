-- How the session's previous turn (that ran) ended.
SELECT status, error_code, error_message
  FROM turns
 WHERE agent_id = %(agent_id)s AND session_key = %(session_key)s
   AND status <> 'running' AND attempt > 0
   AND (%(before)s::bigint IS NULL OR start_position < %(before)s::bigint)
 ORDER BY start_position DESC
 LIMIT 1
