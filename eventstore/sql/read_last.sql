-- The last event of one stream (its primary key, read backwards).
SELECT stream_id, stream_version, global_position, transaction_id::text AS txid_text, event_id,
       type, data::text AS data_text, metadata::text AS meta_text, recorded_at
  FROM events
 WHERE stream_id = %(stream)s
 ORDER BY stream_version DESC
 LIMIT 1
