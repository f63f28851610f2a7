-- Every event about one turn after a checkpoint, in log order (see read_all.sql): a
-- reader that switches from this to the live feed neither skips nor repeats.
SELECT stream_id, stream_version, global_position, transaction_id::text AS txid_text, event_id,
       type, data::text AS data_text, metadata::text AS meta_text, recorded_at
  FROM events
 WHERE metadata ? 'turnId' AND metadata->>'turnId' = %(turn_id)s
   AND transaction_id < (SELECT events_horizon())
   AND (transaction_id, global_position) > (%(txid)s::text::xid8, %(position)s::bigint)
 ORDER BY events.transaction_id, events.global_position
 LIMIT %(limit)s
