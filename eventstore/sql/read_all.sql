-- Checkpointed read of the whole log. Only what is below every append still open is read: an
-- open append may commit later, below a page already read (events_horizon, migration 0012). A
-- transaction that does not append (an idle psql, another database's migration) holds no
-- reader back. The horizon is a scalar subquery: computed once per statement.
-- The select-list alias differs from the ORDER BY column on purpose (an alias named
-- transaction_id would make Postgres sort by the text and abandon the index).
SELECT stream_id, stream_version, global_position, transaction_id::text AS txid_text, event_id,
       type, data::text AS data_text, metadata::text AS meta_text, recorded_at
  FROM events
 WHERE transaction_id < (SELECT events_horizon())
   AND (transaction_id, global_position) > (%(txid)s::text::xid8, %(position)s::bigint)
 ORDER BY events.transaction_id, events.global_position
 LIMIT %(limit)s
