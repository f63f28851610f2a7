-- Advance cursors (never back: two fan-outs racing through a lease hand-over leave the furthest).
INSERT INTO webhook_cursors (webhook_id, txid, position)
SELECT * FROM unnest(%(ids)s::text[], %(txids)s::bigint[], %(positions)s::bigint[])
ON CONFLICT (webhook_id) DO UPDATE
   SET txid = excluded.txid, position = excluded.position
 WHERE (webhook_cursors.txid, webhook_cursors.position) < (excluded.txid, excluded.position)
