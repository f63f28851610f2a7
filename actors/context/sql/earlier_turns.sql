-- The turns of a session accepted before a position, in acceptance order (replay reads their
-- events to rebuild what a later turn read).
SELECT turn_id
  FROM turns
 WHERE agent_id = %(agent_id)s AND session_key = %(session_key)s
   AND start_position < %(before)s
 ORDER BY start_position
