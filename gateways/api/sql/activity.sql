-- The cluster's activity as the log's read models hold it: turns not ended (wherever they run,
-- or wait to resume), and the outbox's unsettled items: the agents' deliveries, then the event
-- webhooks' (no agent's, channel "webhooks"), each pending, in flight and next attempt.
SELECT (SELECT count(*) FROM turns WHERE status = 'running'),
       count(*) FILTER (WHERE status = 'pending' AND NOT hook),
       count(*) FILTER (WHERE status = 'inflight' AND NOT hook),
       min(next_attempt_at) FILTER (WHERE status = 'pending' AND NOT hook),
       count(*) FILTER (WHERE status = 'pending' AND hook),
       count(*) FILTER (WHERE status = 'inflight' AND hook),
       min(next_attempt_at) FILTER (WHERE status = 'pending' AND hook)
  FROM (SELECT status, next_attempt_at, agent_id = '' AND channel_id = 'webhooks' AS hook
          FROM outbox
         WHERE status IN ('pending', 'inflight')) AS unsettled
