-- A subscription's deliveries, newest first: what each carries (webhook_deliveries) and where it
-- stands (the outbox row of the same item), as an operator reads it.
SELECT d.item_id, d.event_id, d.event_type, d.cursor, o.shown, o.attempts, o.uncertain,
       o.error_code, o.error, o.created_at, o.updated_at,
       CASE WHEN o.status = 'pending' THEN o.next_attempt_at END
  FROM webhook_deliveries d
  JOIN (SELECT *, CASE status WHEN 'inflight' THEN 'in_flight' WHEN 'sent' THEN 'delivered'
                              WHEN 'failed' THEN 'dead' ELSE status END AS shown
          FROM outbox) o USING (item_id)
 WHERE d.webhook_id = %(id)s
   AND (%(status)s::text IS NULL OR o.shown = %(status)s::text)
 ORDER BY d.position DESC, d.item_id
 LIMIT %(limit)s
