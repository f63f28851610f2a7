-- The turns of a session in acceptance order (a fork's `atTurn` index counts them from 1), with
-- what a fork needs of each: where its turn.start is and whether it still runs. Whether the
-- session exists at all comes with them (no turns, but a row: it was forked or cleared).
SELECT t.turn_id, t.start_position, t.status
  FROM turns t
 WHERE t.agent_id = %(agent_id)s AND t.session_key = %(session_key)s
 ORDER BY t.start_position, t.turn_id
