-- The checkpoint of the newest event a checkpointed reader can see now.
SELECT transaction_id::text AS txid_text, global_position
  FROM events
 WHERE transaction_id < pg_snapshot_xmin(pg_current_snapshot())
 ORDER BY events.transaction_id DESC, events.global_position DESC
 LIMIT 1
