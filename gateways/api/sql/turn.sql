-- The turn resource (the turns projection, updated inline with every append that changes it),
-- with its deliveries (the outbox rows of the turn, one entry per recipient) and the usage of
-- each of its model calls.
SELECT turn_id, agent_id, session_key, status, state, source, input, text, reasoning,
       steps, attempt,
       prompt_tokens, output_tokens, cache_read_tokens, cache_write_tokens, started_at,
       error_code, error_message, error_hint, ended_at, duration_ms,
       coalesce((SELECT d.deliveries FROM turn_deliveries d WHERE d.turn_id = t.turn_id),
                '[]'::json) AS deliveries,
       calls, handoffs
  FROM turns t
 WHERE turn_id = %(turn_id)s
