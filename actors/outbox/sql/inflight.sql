-- Items whose last event is delivery.attempted: the node died between committing the attempt
-- and recording the provider's answer, so nobody knows whether the provider got them.
SELECT item_id, agent_id, session_key, turn_id, channel_id, recipient, thread,
       chunk_index, chunk_total, body, status, attempts, uncertain, version
  FROM outbox
 WHERE status = 'inflight'
 ORDER BY created_at, item_id
