-- One tool result of a session, by its tool_use id (artifact_read).
SELECT content::text AS content_text
  FROM messages
 WHERE agent_id = %(agent_id)s AND session_key = %(session_key)s AND role = 'tool'
   AND content->>'tool_use_id' = %(id)s
 LIMIT 1
