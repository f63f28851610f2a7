-- The head version of each stream in a batch, live or archived (events_heads, migration 0014:
-- one backward probe of each partition's unique index, and of archived_heads, per stream).
-- No lock is taken: if another transaction appends to one of these streams between this read
-- and our insert, the insert (sql/append.sql) refuses the command and the writer re-decides it.
SELECT stream_id, head FROM events_heads(%(streams)s::text[])
