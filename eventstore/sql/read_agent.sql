-- read_scoped.sql narrowed to an agent (and maybe types): its own statement, so the agent's
-- index (events_agent_checkpoint_idx, 0013) serves it under a generic plan too. A prepared
-- read_scoped.sql, whose agent filter may be NULL, plans for every scope at once and scans the
-- checkpoint index instead (10x slower on 100k events).
SELECT stream_id, stream_version, global_position, transaction_id::text AS txid_text, event_id,
       type, data::text AS data_text, metadata::text AS meta_text, recorded_at
  FROM events
 WHERE metadata->>'agentId' = %(agent_id)s::text
   AND transaction_id < (SELECT events_horizon())
   AND (transaction_id, global_position) > (%(txid)s::text::xid8, %(position)s::bigint)
   AND (%(types)s::text[] IS NULL OR type = ANY(%(types)s::text[]))
 ORDER BY events.transaction_id, events.global_position
 LIMIT %(limit)s
