-- dispach:no-transaction
-- Scoped reads of the log (sql/read_scoped.sql: the firehose narrowed to an agent, or to one
-- session of it) find their rows by the scope and page in log order without a sort, as turn
-- reads do with events_turn_idx (0004). The definitions, exactly:
--   events_agent_checkpoint_idx   ON events ((metadata->>'agentId'), transaction_id,
--                                            global_position)
--   events_session_checkpoint_idx ON events ((metadata->>'agentId'), (metadata->>'sessionKey'),
--                                            transaction_id, global_position)
-- Not partial: read_scoped.sql does not repeat a `metadata ? 'agentId'` the planner would need.
-- A type filter is applied to the rows they find.
--
-- Built CONCURRENTLY, so appends go on during the build on a large log; hence outside a
-- transaction (eventstore/migrations.py), one statement at a time. A build interrupted by a crash
-- or a cancel leaves an INVALID index of its name, and a rerun starts from the first statement:
-- each index is dropped (concurrently too) before it is built, so a rerun finishes the job (at
-- worst rebuilding one that was complete).
DROP INDEX CONCURRENTLY IF EXISTS events_agent_checkpoint_idx;
CREATE INDEX CONCURRENTLY events_agent_checkpoint_idx
    ON events ((metadata->>'agentId'), transaction_id, global_position);
DROP INDEX CONCURRENTLY IF EXISTS events_session_checkpoint_idx;
CREATE INDEX CONCURRENTLY events_session_checkpoint_idx
    ON events ((metadata->>'agentId'), (metadata->>'sessionKey'), transaction_id, global_position);
