-- Every committed event in checkpoint order, for a rebuild that holds its projection's tables
-- locked in a REPEATABLE READ transaction (no snapshot-horizon filter: see projection.rebuild).
SELECT stream_id, stream_version, global_position, transaction_id::text AS txid_text, event_id,
       type, data::text AS data_text, metadata::text AS meta_text, recorded_at
  FROM events
 ORDER BY events.transaction_id, events.global_position
