-- The oldest transaction of the cluster that holds an xid (any database): readers stop below the
-- oldest running xid (pg_snapshot_xmin), so its age is how far the live streams may lag.
-- A read-only transaction has no xid and holds nothing back. Never its query: only who it is.
SELECT pid,
       extract(epoch FROM now() - xact_start)::float8 AS age_s,
       coalesce(state, ''),
       coalesce(datname, ''),
       coalesce(application_name, '')
  FROM pg_stat_activity
 WHERE backend_xid IS NOT NULL
   AND xact_start IS NOT NULL
   AND pid <> pg_backend_pid()
 ORDER BY xact_start
 LIMIT 1
