-- The log after a checkpoint narrowed to an agent (and a session) and to some types, filtered in
-- Postgres so a catch-up transfers only what the reader wants. NULL parameters do not narrow.
SELECT stream_id, stream_version, global_position, transaction_id::text AS txid_text, event_id,
       type, data::text AS data_text, metadata::text AS meta_text, recorded_at
  FROM events
 WHERE transaction_id < (SELECT events_horizon())
   AND (transaction_id, global_position) > (%(txid)s::text::xid8, %(position)s::bigint)
   AND (%(agent_id)s::text IS NULL OR metadata->>'agentId' = %(agent_id)s::text)
   AND (%(session_key)s::text IS NULL OR metadata->>'sessionKey' = %(session_key)s::text)
   AND (%(types)s::text[] IS NULL OR type = ANY(%(types)s::text[]))
 ORDER BY events.transaction_id, events.global_position
 LIMIT %(limit)s
