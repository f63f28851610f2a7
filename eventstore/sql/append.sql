-- Insert a batch of commands in one statement; each input row is one event, `ord` its place in
-- its command. The rows come as one JSON array, one parameter that msgspec encodes (psycopg's
-- adaptation of seven arrays cost the writer thread more Python per batch). All rows of a
-- command see the same head (the statement's snapshot), so a command is inserted whole or not at
-- all: not when its expected version is not the head (a conflict, which the writer then
-- explains). Heads are read without a lock: if another transaction appends to one of these
-- streams (or already stored one of these event ids), a unique index refuses the insert and the
-- writer decides the batch again, carefully, against what was committed.
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
-- partitions never deadlock. A partition without a fence row refuses nothing.
WITH fences AS (
    SELECT f.partition, f.epoch
      FROM partition_fences f
     WHERE f.partition = ANY(%(parts)s::int[])
     ORDER BY f.partition
       FOR SHARE),
     current AS MATERIALIZED (
    SELECT jsonb_object_agg(partition, epoch) AS epochs FROM fences)
INSERT INTO events (stream_id, stream_version, event_id, type, data, metadata)
SELECT i.stream_id, h.head + 1 + i.ord, i.event_id, i.type, i.data, i.metadata
  FROM ROWS FROM (jsonb_to_recordset(%(rows)s::jsonb)
                  AS (stream_id text, expected bigint, ord int, event_id uuid, type text,
                      data jsonb, metadata jsonb, part int, epoch bigint))
       WITH ORDINALITY AS i(stream_id, expected, ord, event_id, type, data, metadata, part, epoch,
                            n)
 CROSS JOIN LATERAL (
       SELECT coalesce((SELECT e.stream_version
                          FROM events e
                         WHERE e.stream_id = i.stream_id
                         ORDER BY e.stream_version DESC
                         LIMIT 1), -1) AS head) AS h
 CROSS JOIN current c
 WHERE (i.expected = -2 OR i.expected = h.head)
   AND (i.epoch IS NULL OR coalesce((c.epochs ->> i.part::text)::bigint, i.epoch) <= i.epoch)
 ORDER BY i.n
RETURNING event_id, global_position, stream_version, transaction_id::text AS txid_text, recorded_at
