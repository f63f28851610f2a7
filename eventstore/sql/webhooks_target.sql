-- Where a delivery goes and what signs it; deleted_at tells the sender the subscription is gone.
SELECT w.url, s.secret, w.deleted_at IS NOT NULL
  FROM webhooks w JOIN webhook_secrets s USING (webhook_id)
 WHERE w.webhook_id = %(id)s
