-- The archive holding a turn's first event, if its partition of the log was archived and not
-- restored (eventstore/archive.py).
SELECT a.archive_id
  FROM turns t
  JOIN log_archives a ON a.restored_at IS NULL
                     AND t.start_position BETWEEN a.first_position AND a.last_position
 WHERE t.turn_id = %(turn_id)s
 LIMIT 1
