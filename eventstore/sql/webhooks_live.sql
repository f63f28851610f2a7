-- The live subscriptions and where the fan-out got to for each: its saved cursor, else the
-- checkpoint of the subscription's webhook.created.
SELECT w.webhook_id, w.events, w.agents,
       coalesce(c.txid, w.created_txid), coalesce(c.position, w.created_position)
  FROM webhooks w LEFT JOIN webhook_cursors c USING (webhook_id)
 WHERE w.deleted_at IS NULL
