-- Every partition's fence epoch.
SELECT partition, epoch FROM partition_fences ORDER BY partition
