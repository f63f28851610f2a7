-- The events of some turns (any stream), of some types, in log order: through the turn index,
-- so reading a session's turns costs what they hold, not a scan of the log.
SELECT stream_id, stream_version, global_position, transaction_id::text AS txid_text, event_id,
       type, data::text AS data_text, metadata::text AS meta_text, recorded_at
  FROM events
 WHERE metadata ? 'turnId' AND metadata->>'turnId' = ANY(%(turn_ids)s::text[])
   AND type = ANY(%(types)s::text[])
 ORDER BY global_position
