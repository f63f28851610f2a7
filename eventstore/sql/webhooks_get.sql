SELECT webhook_id, url, events, agents, description, created_at, deleted_at, version
  FROM webhooks
 WHERE webhook_id = %(id)s
