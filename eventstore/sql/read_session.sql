-- read_scoped.sql narrowed to one session of an agent (and maybe types), served by
-- events_session_checkpoint_idx (0013) under any plan (see read_agent.sql).
SELECT stream_id, stream_version, global_position, transaction_id::text AS txid_text, event_id,
       type, data::text AS data_text, metadata::text AS meta_text, recorded_at
  FROM events
 WHERE metadata->>'agentId' = %(agent_id)s::text
   AND metadata->>'sessionKey' = %(session_key)s::text
   AND transaction_id < (SELECT events_horizon())
   AND (transaction_id, global_position) > (%(txid)s::text::xid8, %(position)s::bigint)
   AND (%(types)s::text[] IS NULL OR type = ANY(%(types)s::text[]))
 ORDER BY events.transaction_id, events.global_position
 LIMIT %(limit)s
