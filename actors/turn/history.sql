-- A session's history before a turn: the messages of the other turns that ran (attempt > 0) and
-- ended, turn by turn in acceptance order (a turn's first row is its turn.start), each turn's rows
-- in log order. Ordering by position alone would interleave turns: a queued turn's message is
-- stored when it is accepted, before the turn ahead of it has answered. Turns still queued and
-- turns stopped before they ran are not history (the node's in-memory history agrees).
SELECT m.role, m.content::text AS content_text
  FROM messages m
  JOIN turns t ON t.turn_id = m.turn_id
 WHERE m.agent_id = %(agent_id)s AND m.session_key = %(session_key)s
   AND m.turn_id <> %(turn_id)s AND t.status <> 'running' AND t.attempt > 0
 ORDER BY min(m.position) OVER (PARTITION BY m.turn_id), m.position
