-- Items whose last event is delivery.attempted: a node committed the attempt and has not (yet)
-- recorded the provider's answer. Whether that node is dead is decided by the caller from
-- `node` and how long ago the attempt was (`age`, by the database's clock).
SELECT item_id, agent_id, session_key, turn_id, channel_id, recipient, thread,
       chunk_index, chunk_total, body, status, attempts, uncertain, version,
       node, extract(epoch FROM now() - updated_at) AS age
  FROM outbox
 WHERE status = 'inflight'
 ORDER BY created_at, item_id
 LIMIT 1000
