-- The head version of each stream in a batch: one backward probe of the primary key per stream.
-- No lock is taken: if another transaction appends to one of these streams between this read and
-- our insert, the primary key refuses our insert and the writer re-decides the batch.
SELECT s.stream_id,
       (SELECT e.stream_version
          FROM events e
         WHERE e.stream_id = s.stream_id
         ORDER BY e.stream_version DESC
         LIMIT 1) AS head
  FROM unnest(%(streams)s::text[]) AS s(stream_id)
