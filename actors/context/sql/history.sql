-- What a turn of a session reads of the session's past, in one statement (one round trip for
-- the first turn of every session a node activates), as rows of three kinds:
--
-- 0. the session's sticky compaction view: its newest digest and the marks after it (at most
--    one row: `a` the digest, `b` the marks);
-- 1. how the session's previous turn that ran ended (at most one row: `a` its status, `b` its
--    error code, `c` its error message);
-- 2. the history rows after the digest: the messages of turns that ran (attempt > 0) and
--    ended, started after the digest's last turn (and before `before`, the turn asking), turn
--    by turn in acceptance order, each turn's rows in log order (`a` the turn id, `start` its
--    turn.start position, `b` the role, `c` the content). A turn's rows all come after its
--    turn.start, so the range on the messages key bounds the read to what the digest does
--    not cover: O(window), not O(history).
WITH view AS (
    SELECT c.digest, c.marks
      FROM session_context c
     WHERE c.agent_id = %(agent_id)s AND c.session_key = %(session_key)s),
     after AS (
    SELECT coalesce((SELECT (v.digest ->> 'through')::bigint FROM view v), -1) AS position)
SELECT 0 AS kind, NULL::bigint AS start, NULL::bigint AS position,
       v.digest::text AS a, v.marks::text AS b, NULL::text AS c
  FROM view v
UNION ALL
(SELECT 1, NULL, NULL, t.status, t.error_code, t.error_message
   FROM turns t
  WHERE t.agent_id = %(agent_id)s AND t.session_key = %(session_key)s
    AND t.status <> 'running' AND t.attempt > 0
    AND (%(before)s::bigint IS NULL OR t.start_position < %(before)s::bigint)
  ORDER BY t.start_position DESC
  LIMIT 1)
UNION ALL
SELECT 2, t.start_position, m.position, m.turn_id, m.role, m.content::text
  FROM after x, messages m
  JOIN turns t ON t.turn_id = m.turn_id
 WHERE m.agent_id = %(agent_id)s AND m.session_key = %(session_key)s
   AND m.position > x.position AND t.start_position > x.position
   AND (%(before)s::bigint IS NULL OR t.start_position < %(before)s::bigint)
   AND t.status <> 'running' AND t.attempt > 0
 ORDER BY kind, start, position
