-- The turn resource (the turns projection, updated inline with every append that changes it).
SELECT turn_id, agent_id, session_key, status, state, source, input, text, steps, attempt,
       prompt_tokens, output_tokens, cache_read_tokens, cache_write_tokens, started_at,
       error_code, error_message, error_hint, ended_at, duration_ms
  FROM turns
 WHERE turn_id = %(turn_id)s
