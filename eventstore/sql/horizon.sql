-- What can hold the log back, as the health probe sees it (eventstore/health.py); never a query's
-- text, only who it is. At most two rows:
-- 1. the oldest open append (it holds the append lock of migration 0012): every reader of the log
--    waits for it, and an append is open for milliseconds;
-- 2. the cluster's oldest transaction holding an xid (any database): vacuum cannot reclaim rows
--    that died after it began. Readers of the log do not wait for it.
-- A read-only transaction has no xid and holds nothing back.
(SELECT a.pid,
        extract(epoch FROM now() - a.xact_start)::float8 AS age_s,
        coalesce(a.state, ''),
        coalesce(a.datname, ''),
        coalesce(a.application_name, ''),
        true AS appending
   FROM pg_locks l
   JOIN pg_stat_activity a ON a.pid = l.pid
  WHERE l.locktype = 'advisory'
    AND l.classid = 1146045283
    AND l.objid = to_regclass(%(events)s)
    AND l.objsubid = 2
    AND l.granted
    AND a.xact_start IS NOT NULL
  ORDER BY a.xact_start
  LIMIT 1)
UNION ALL
(SELECT pid,
        extract(epoch FROM now() - xact_start)::float8 AS age_s,
        coalesce(state, ''),
        coalesce(datname, ''),
        coalesce(application_name, ''),
        false AS appending
   FROM pg_stat_activity
  WHERE backend_xid IS NOT NULL
    AND xact_start IS NOT NULL
    AND pid <> pg_backend_pid()
  ORDER BY xact_start
  LIMIT 1)
