-- The current fence epoch of some partitions, for the writer to explain a refused append (no
-- lock: a command found acceptable here is inserted by sql/append.sql, which checks again under
-- its lock).
SELECT partition, epoch
  FROM partition_fences
 WHERE partition = ANY(%(parts)s::int[])
