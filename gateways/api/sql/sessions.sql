-- Sessions of an agent (asynchronous projection: a session appears within moments of its first
-- turn), most recently active first, with the size of their current history and the status of
-- their last turn (the turn resource, inline, so it may be newer than the session row: a turn
-- the row names has its turns row already). `q` matches the key as a substring, case aside:
-- strpos, not LIKE, so a percent sign or an underscore in it is only itself (and no percent
-- sign in this file: psycopg would read it as a placeholder). `status` filters on that last turn.
SELECT s.agent_id, s.session_key, s.turns,
       (SELECT count(*) FROM messages m
         WHERE m.agent_id = s.agent_id AND m.session_key = s.session_key) AS messages,
       s.first_seen_at, s.last_activity_at, s.last_turn_id, s.cleared_at,
       t.status AS last_turn_status, t.started_at AS last_turn_at, s.phase,
       -- Last, whatever is added above it: gateways/sessions.py reads it as the last column.
       s.forked_from::text AS forked_from_text
  FROM sessions s
  LEFT JOIN turns t ON t.turn_id = s.last_turn_id
 WHERE s.agent_id = %(agent_id)s
   AND (%(session_key)s::text IS NULL OR s.session_key = %(session_key)s::text)
   AND (%(q)s::text IS NULL OR strpos(lower(s.session_key), lower(%(q)s::text)) > 0)
   AND (%(status)s::text IS NULL OR t.status = %(status)s::text)
 ORDER BY s.last_activity_at DESC, s.session_key
 LIMIT %(limit)s
