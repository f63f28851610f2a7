-- The cluster's activity as the log's read models hold it: turns not ended (wherever they run,
-- or wait to resume), and the outbox's unsettled items.
SELECT (SELECT count(*) FROM turns WHERE status = 'running'),
       count(*) FILTER (WHERE status = 'pending'),
       count(*) FILTER (WHERE status = 'inflight'),
       min(next_attempt_at) FILTER (WHERE status = 'pending')
  FROM outbox
 WHERE status IN ('pending', 'inflight')
