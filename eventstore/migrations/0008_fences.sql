-- Partition fences (issue 14): the epoch of the newest lease of each partition. A node that lost
-- a partition's lease may still have appends queued or in flight; the append statement inserts a
-- fenced event only while no fence of its partition is greater than the epoch it carries, and
-- takes the fence row FOR SHARE, so a new owner's raise (an UPDATE, greatest epoch wins) waits
-- for those appends to commit and every append after it sees the new epoch (eventstore/fencing.py).
CREATE TABLE partition_fences (
    partition int    PRIMARY KEY,
    epoch     bigint NOT NULL
);
