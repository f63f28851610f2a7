SELECT webhook_id, url, events, agents, description, created_at, deleted_at, version
  FROM webhooks
 WHERE deleted_at IS NULL
 ORDER BY created_position, webhook_id
