-- The history rows of a session after its digest: the messages of turns that ran (attempt > 0)
-- and ended, started after the digest's last turn (and before `before`, the turn asking),
-- turn by turn in acceptance order, each turn's rows in log order. A turn's rows all come
-- after its turn.start, so the range on the messages key bounds the read to what the digest
-- does not cover: O(window), not O(history). The digest's last turn is read here, not passed
-- in, so this read need not wait for snapshot.sql's (load.py runs them side by side).
WITH after AS (
    SELECT coalesce((SELECT (c.digest ->> 'through')::bigint
                       FROM session_context c
                      WHERE c.agent_id = %(agent_id)s AND c.session_key = %(session_key)s),
                    -1) AS position)
SELECT m.turn_id, t.start_position, m.role, m.content::text AS content_text
  FROM after a, messages m
  JOIN turns t ON t.turn_id = m.turn_id
 WHERE m.agent_id = %(agent_id)s AND m.session_key = %(session_key)s
   AND m.position > a.position AND t.start_position > a.position
   AND (%(before)s::bigint IS NULL OR t.start_position < %(before)s::bigint)
   AND t.status <> 'running' AND t.attempt > 0
 ORDER BY t.start_position, m.position
