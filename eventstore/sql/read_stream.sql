-- One stream in version order. Versions are dense and a version is only written after its
-- predecessor committed, so no snapshot filter is needed here.
SELECT stream_id, stream_version, global_position, transaction_id::text AS txid_text, event_id,
       type, data::text AS data_text, metadata::text AS meta_text, recorded_at
  FROM events
 WHERE stream_id = %(stream)s AND stream_version >= %(from_version)s
 ORDER BY stream_version
 LIMIT %(limit)s
