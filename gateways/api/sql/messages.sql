-- A session's history, newest first (Dispach v1's order), paged by log position.
SELECT position, session_key, turn_id, role, content::text, recorded_at
  FROM messages
 WHERE agent_id = %(agent_id)s AND session_key = %(session_key)s
   AND (%(before)s::bigint IS NULL OR position < %(before)s::bigint)
 ORDER BY position DESC
 LIMIT %(limit)s
