-- The outbox items this node is sending now (claimed by its last delivery.attempted): the
-- agents' deliveries, then the event webhooks' (no agent's, channel "webhooks").
SELECT count(*) FILTER (WHERE NOT (agent_id = '' AND channel_id = 'webhooks')),
       count(*) FILTER (WHERE agent_id = '' AND channel_id = 'webhooks')
  FROM outbox
 WHERE status = 'inflight' AND node = %(node)s
