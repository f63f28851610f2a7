-- An outbox row keeps its chunk's text only while the item may still be sent (pending or in
-- flight): the outbox projection sets `body` to NULL when it settles the item (sent, failed,
-- uncertain without a resend), since nothing reads it after that (the deliveries page never
-- selects it) and the item's delivery.enqueued keeps the text. Rows settled before this
-- migration are cleared here, so that they look as a rebuild would leave them.
ALTER TABLE outbox ALTER COLUMN body DROP NOT NULL;
UPDATE outbox SET body = NULL WHERE status IN ('sent', 'failed', 'uncertain');
