-- Insert a batch of commands in one statement; each input row is one event, `ord` its place in
-- its command. The rows come as one JSON array, one parameter that msgspec encodes (psycopg's
-- adaptation of seven arrays cost the writer thread more Python per batch). A command is
-- inserted whole or not at all: not when its expected version is not the head (a conflict,
-- which the writer then explains), and not when one of its event ids is already stored in any
-- partition of the log (a retried append, which the writer answers with the stored originals).
--
-- The log is partitioned (migration 0014): (stream_id, stream_version) and event_id are unique
-- only within a partition, so this statement is what keeps them unique across the log. It can:
-- the heads and the stored ids are read by VOLATILE functions (events_heads, events_stored) that
-- first lock the batch's streams (events_lock_streams: an append of one of them by another node
-- waits for this one to end, and this one for it), and whose queries take their snapshot after
-- those locks; the statement's own snapshot was taken before them and would miss an append that
-- committed while this one waited. Each is called once per batch (the MATERIALIZED CTEs). A
-- command none of whose ids is stored may still collide with another command of the same batch
-- on an id: only the first is inserted (a second one inside the same partition would be refused
-- by its unique index anyway), and the writer explains the other. A unique index that refuses a
-- row anyway (a writer of an older version of this statement) makes the writer decide the batch
-- again, carefully. The fence rows below may be locked before or after the streams: an append
-- and a raise of the same partition by two nodes during a hand-over can then deadlock, which
-- Postgres ends after deadlock_timeout by aborting one; the writer retries it (idempotently).
--
-- Fencing (eventstore/fencing.py): a fenced row (`part` and `epoch` set; both null when its
-- command is unfenced) is inserted only when its partition's fence is not greater than its epoch.
-- `parts` lists the batch's fenced partitions. Their fence rows are taken FOR SHARE until this
-- transaction ends: a raise (an UPDATE of the row) waits for this append to commit, and an append
-- whose lock waits on a raise reads the raised row once it commits (READ COMMITTED re-checks a
-- locked row's newest version), so no append under a stale epoch commits after a raise returns.
-- `current` folds the locked rows into one {partition: epoch} object, computed once (joining
-- each row to the fence rows made the statement ~70 percent slower at 512 rows and 64
-- partitions), and it reads them all before the first row can be inserted: each inserted fenced
-- row was checked against a locked fence. The rows are locked in partition order (LockRows runs
-- above the sort), the order a raise updates them in, so an append and a raise of several
-- partitions never deadlock. A partition without a fence row refuses nothing. (Fence partitions
-- are the cluster's session partitions, not the log's.)
WITH fences AS (
    SELECT f.partition, f.epoch
      FROM partition_fences f
     WHERE f.partition = ANY(%(parts)s::int[])
     ORDER BY f.partition
       FOR SHARE),
     current AS MATERIALIZED (
    SELECT jsonb_object_agg(partition, epoch) AS epochs FROM fences),
     input AS MATERIALIZED (
    SELECT *
      FROM ROWS FROM (jsonb_to_recordset(%(rows)s::jsonb)
                      AS (stream_id text, expected bigint, ord int, event_id uuid, type text,
                          data jsonb, metadata jsonb, part int, epoch bigint))
           WITH ORDINALITY AS i(stream_id, expected, ord, event_id, type, data, metadata, part,
                                epoch, n)),
     streams AS MATERIALIZED (
    SELECT ARRAY(SELECT DISTINCT stream_id FROM input) AS ids),
     heads AS MATERIALIZED (
    SELECT h.stream_id, coalesce(h.head, -1) AS head
      FROM streams, events_heads(streams.ids, streams.ids) AS h),
     stored AS MATERIALIZED (
    SELECT s.event_id
      FROM streams, events_stored(ARRAY(SELECT event_id FROM input), streams.ids) AS s(event_id)),
     refused AS MATERIALIZED (
    SELECT DISTINCT i.stream_id
      FROM input i
     WHERE i.event_id IN (SELECT event_id FROM stored)
        OR EXISTS (SELECT 1 FROM input j
                    WHERE j.event_id = i.event_id AND j.stream_id <> i.stream_id AND j.n < i.n))
INSERT INTO events (stream_id, stream_version, event_id, type, data, metadata)
SELECT i.stream_id, h.head + 1 + i.ord, i.event_id, i.type, i.data, i.metadata
  FROM input i
  JOIN heads h ON h.stream_id = i.stream_id
 CROSS JOIN current c
 WHERE (i.expected = -2 OR i.expected = h.head)
   AND (i.epoch IS NULL OR coalesce((c.epochs ->> i.part::text)::bigint, i.epoch) <= i.epoch)
   AND i.stream_id NOT IN (SELECT stream_id FROM refused)
 ORDER BY i.n
RETURNING event_id, global_position, stream_version, transaction_id::text AS txid_text, recorded_at
