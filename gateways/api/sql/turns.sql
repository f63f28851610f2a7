-- An agent's turns, newest first, optionally of one session and one status. Pages continue
-- strictly before the (started_at, turn_id) of the `before` turn, so equal start times neither
-- repeat nor vanish between pages.
SELECT turn_id, agent_id, session_key, status, state, source, input, text, reasoning,
       steps, attempt,
       prompt_tokens, output_tokens, cache_read_tokens, cache_write_tokens, started_at,
       error_code, error_message, error_hint, ended_at, duration_ms,
       coalesce((SELECT d.deliveries FROM turn_deliveries d WHERE d.turn_id = t.turn_id),
                '[]'::json) AS deliveries,
       calls, handoffs
  FROM turns t
 WHERE agent_id = %(agent_id)s
   AND (%(session_key)s::text IS NULL OR session_key = %(session_key)s::text)
   AND (%(status)s::text IS NULL OR status = %(status)s::text)
   AND (%(before_at)s::timestamptz IS NULL
        OR (started_at, turn_id) < (%(before_at)s::timestamptz, %(before_id)s::text))
 ORDER BY started_at DESC, turn_id DESC
 LIMIT %(limit)s
