-- Sessions of an agent (asynchronous projection: a session appears within moments of its first
-- turn), most recently active first, with the size of their current history.
SELECT s.agent_id, s.session_key, s.turns,
       (SELECT count(*) FROM messages m
         WHERE m.agent_id = s.agent_id AND m.session_key = s.session_key) AS messages,
       s.first_seen_at, s.last_activity_at, s.last_turn_id, s.cleared_at
  FROM sessions s
 WHERE s.agent_id = %(agent_id)s
   AND (%(session_key)s::text IS NULL OR s.session_key = %(session_key)s::text)
 ORDER BY s.last_activity_at DESC, s.session_key
 LIMIT %(limit)s
