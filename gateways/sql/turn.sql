-- The turn resource (the turns projection, updated inline with every append that changes it),
-- with its deliveries (the outbox rows of the turn, one entry per recipient).
SELECT turn_id, agent_id, session_key, status, state, source, input, text, steps, attempt,
       prompt_tokens, output_tokens, cache_read_tokens, cache_write_tokens, started_at,
       error_code, error_message, error_hint, ended_at, duration_ms,
       (SELECT coalesce(json_agg(d ORDER BY d.channel, d."to", d.thread), '[]'::json)
          FROM (SELECT o.channel_id AS channel, o.recipient AS "to", o.thread,
                       CASE WHEN bool_or(o.status = 'failed') THEN 'failed'
                            WHEN bool_and(o.status = 'sent') THEN 'sent'
                            WHEN bool_and(o.status IN ('sent', 'uncertain')) THEN 'uncertain'
                            WHEN bool_or(o.status = 'inflight') THEN 'sending'
                            ELSE 'pending' END AS status,
                       count(*) AS chunks,
                       count(*) FILTER (WHERE o.status = 'sent') AS sent,
                       max(o.attempts) AS attempts,
                       bool_or(o.uncertain) AS uncertain,
                       min(o.error_code) FILTER (WHERE o.status = 'failed'
                                                  AND o.error_code <> 'delivery_chunk_abandoned')
                           AS "errorCode"
                  FROM outbox o
                 WHERE o.turn_id = t.turn_id
                 GROUP BY o.channel_id, o.recipient, o.thread) d) AS deliveries
  FROM turns t
 WHERE turn_id = %(turn_id)s
