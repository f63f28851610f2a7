-- Insert a batch of commands in one statement; each input row is one event, `ord` its place in
-- its command. The rows come as one JSON array, one parameter that msgspec encodes (psycopg's
-- adaptation of seven arrays cost the writer thread more Python per batch). All rows of a
-- command see the same head (the statement's snapshot), so a command is inserted whole or not at
-- all: not when its expected version is not the head (a conflict, which the writer then
-- explains). Heads are read without a lock: if another transaction appends to one of these
-- streams (or already stored one of these event ids), a unique index refuses the insert and the
-- writer decides the batch again, carefully, against what was committed.
INSERT INTO events (stream_id, stream_version, event_id, type, data, metadata)
SELECT i.stream_id, h.head + 1 + i.ord, i.event_id, i.type, i.data, i.metadata
  FROM ROWS FROM (jsonb_to_recordset(%(rows)s::jsonb)
                  AS (stream_id text, expected bigint, ord int, event_id uuid, type text,
                      data jsonb, metadata jsonb))
       WITH ORDINALITY AS i(stream_id, expected, ord, event_id, type, data, metadata, n)
 CROSS JOIN LATERAL (
       SELECT coalesce((SELECT e.stream_version
                          FROM events e
                         WHERE e.stream_id = i.stream_id
                         ORDER BY e.stream_version DESC
                         LIMIT 1), -1) AS head) AS h
 WHERE i.expected = -2 OR i.expected = h.head
 ORDER BY i.n
RETURNING event_id, global_position, stream_version, transaction_id::text AS txid_text, recorded_at
