-- A session's sticky compaction view: its newest digest and the marks after it.
SELECT digest::text AS digest_text, marks::text AS marks_text
  FROM session_context
 WHERE agent_id = %(agent_id)s AND session_key = %(session_key)s
