-- Checkpointed read of the whole log. Appends commit in checkpoint order (migration 0012), so
-- what this statement sees is a prefix of the log and whatever commits later sorts after it:
-- no horizon to wait for, whatever other transactions the server runs.
-- The select-list alias differs from the ORDER BY column on purpose (an alias named
-- transaction_id would make Postgres sort by the text and abandon the index).
SELECT stream_id, stream_version, global_position, transaction_id::text AS txid_text, event_id,
       type, data::text AS data_text, metadata::text AS meta_text, recorded_at
  FROM events
 WHERE (transaction_id, global_position) > (%(txid)s::text::xid8, %(position)s::bigint)
 ORDER BY events.transaction_id, events.global_position
 LIMIT %(limit)s
