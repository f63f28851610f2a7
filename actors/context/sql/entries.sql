-- The history rows of a session after its digest: the messages of turns that ran (attempt > 0)
-- and ended, started after the digest's last turn (and before `before`, the turn asking),
-- turn by turn in acceptance order, each turn's rows in log order. A turn's rows all come
-- after its turn.start, so the range on the messages key bounds the read to what the digest
-- does not cover: O(window), not O(history).
SELECT m.turn_id, t.start_position, m.role, m.content::text AS content_text
  FROM messages m
  JOIN turns t ON t.turn_id = m.turn_id
 WHERE m.agent_id = %(agent_id)s AND m.session_key = %(session_key)s
   AND m.position > %(after)s AND t.start_position > %(after)s
   AND (%(before)s::bigint IS NULL OR t.start_position < %(before)s::bigint)
   AND t.status <> 'running' AND t.attempt > 0
 ORDER BY t.start_position, m.position
