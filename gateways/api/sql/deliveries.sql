-- An agent's outbox items, newest first (by their place in line: the global position of their
-- delivery.enqueued), with their state as a person reads it: `pending` before the first
-- attempt, `retrying` when waiting after a failed or doubtful one, `sending` while an attempt
-- is in flight, then `sent`, `failed` or `uncertain`. The item's text (the reply) is not
-- selected: this page says where a reply stands, never what it says.
SELECT item_id, channel_id, recipient, thread, session_key, turn_id, chunk_index, chunk_total,
       shown, attempts, uncertain, error_code, error, provider_message_id,
       created_at, updated_at,
       CASE WHEN status = 'sent' THEN updated_at END AS sent_at,
       CASE WHEN status = 'pending' THEN next_attempt_at END AS next_attempt_at
  FROM (SELECT item_id, channel_id, recipient, thread, session_key, turn_id, chunk_index,
               chunk_total, status, attempts, uncertain, error_code, error,
               provider_message_id, created_at, updated_at, next_attempt_at, position,
               CASE WHEN status = 'pending' AND attempts > 0 THEN 'retrying'
                    WHEN status = 'inflight' THEN 'sending'
                    ELSE status END AS shown
          FROM outbox
         WHERE agent_id = %(agent_id)s
           AND (%(session_key)s::text IS NULL OR session_key = %(session_key)s::text)) o
 WHERE (%(status)s::text IS NULL OR shown = %(status)s::text)
 ORDER BY position DESC, item_id
 LIMIT %(limit)s
