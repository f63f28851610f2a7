-- An agent's turns, newest first, optionally of one session and one status. Pages continue
-- strictly before the (started_at, turn_id) of the `before` turn, so equal start times neither
-- repeat nor vanish between pages.
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
 WHERE agent_id = %(agent_id)s
   AND (%(session_key)s::text IS NULL OR session_key = %(session_key)s::text)
   AND (%(status)s::text IS NULL OR status = %(status)s::text)
   AND (%(before_at)s::timestamptz IS NULL
        OR (started_at, turn_id) < (%(before_at)s::timestamptz, %(before_id)s::text))
 ORDER BY started_at DESC, turn_id DESC
 LIMIT %(limit)s
