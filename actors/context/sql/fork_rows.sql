-- The history rows of a session whose turns were accepted up to a position, in the order its
-- history is read (turn by turn in acceptance order, each turn's rows in log order), with
-- whether each row's turn ran and ended (only those are history: see entries.sql). One
-- statement, so one snapshot: a clear that deleted the rows of the turn asked for shows as
-- that turn having no row at all (every turn has one from its turn.start until a clear).
SELECT m.turn_id, m.position, m.role, m.content::text AS content_text,
       (t.status <> 'running' AND t.attempt > 0) AS ran
  FROM messages m
  JOIN turns t ON t.turn_id = m.turn_id
 WHERE m.agent_id = %(agent_id)s AND m.session_key = %(session_key)s
   AND t.start_position <= %(through)s
 ORDER BY t.start_position, m.position
