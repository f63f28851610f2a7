-- A session's history before a turn: the messages of every other turn, in log order.
SELECT role, content::text AS content_text
  FROM messages
 WHERE agent_id = %(agent_id)s AND session_key = %(session_key)s AND turn_id <> %(turn_id)s
 ORDER BY position
