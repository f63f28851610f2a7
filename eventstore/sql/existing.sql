-- Events of a batch that are already stored, in any partition: a retried append returns these
-- instead of failing. (One probe of each partition's event_id index per id; an id archived with
-- its partition is not found: a retry never comes that late.)
SELECT stream_id, stream_version, global_position, transaction_id::text AS txid_text, event_id,
       type, data::text AS data_text, metadata::text AS meta_text, recorded_at
  FROM events
 WHERE event_id = ANY(%(ids)s::uuid[])
