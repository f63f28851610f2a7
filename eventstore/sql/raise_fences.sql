-- Raise partitions' fences to new lease epochs; the greatest epoch wins, so a late raise of an
-- older lease never lowers a fence. Updating a row waits for the appends that hold it FOR SHARE
-- (sql/append.sql) to commit, so once this commits no append under an older epoch can. The rows
-- come sorted by partition and are locked in that order, as appends lock them: no deadlock.
-- Returns each partition's epoch now: a caller whose epoch is lower has been superseded.
INSERT INTO partition_fences (partition, epoch)
SELECT p.partition, p.epoch
  FROM unnest(%(parts)s::int[], %(epochs)s::bigint[]) WITH ORDINALITY AS p(partition, epoch, n)
 ORDER BY p.n
    ON CONFLICT (partition) DO UPDATE SET epoch = greatest(partition_fences.epoch, EXCLUDED.epoch)
RETURNING partition, epoch
