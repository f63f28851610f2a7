-- Readers of the log wait only for appends, not for every transaction of the server.
--
-- A reader pages by (transaction_id, global_position) and must not pass a transaction that is
-- still open: it may commit later, below the page already read. Until now a reader stopped below
-- the oldest running transaction of the whole cluster (pg_snapshot_xmin), so any transaction
-- anywhere on the server (an idle psql session after a write, a migration of another database)
-- froze every live stream for as long as it stayed open.
--
-- Now every statement that inserts into the log first takes a transaction-scoped advisory lock in
-- SHARE mode (appends never wait for each other on it), keyed by the table's oid, before its
-- transaction has an id. A reader (events_horizon) stops below the oldest transaction of its
-- snapshot that is still open unless Postgres's lock table shows it running without that lock:
-- such a transaction can never append in this log, since an append whose transaction already
-- holds an id is refused. A transaction that ended since the snapshot, or whose locks the reader
-- cannot see yet, is waited for (it delays one page, it is never skipped).
CREATE FUNCTION events_commit_order() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('dispach.appending', true) IS DISTINCT FROM 'on' THEN
        IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
            RAISE EXCEPTION 'an append must be the first write of its transaction'
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'append to the log before any other write of the transaction, '
                             'so readers know to wait for it';
        END IF;
        PERFORM pg_advisory_xact_lock_shared(1146045283, TG_RELID::integer);
        PERFORM set_config('dispach.appending', 'on', true);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER events_commit_order
    BEFORE INSERT ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_commit_order();

-- The transaction id below which the calling statement may read the log: everything it sees
-- there is final. STABLE, so it runs on the caller's snapshot (pg_current_snapshot is the
-- statement's); call it once per statement, as `(SELECT events_horizon())`. The lock table is
-- read only while the snapshot has open transactions, once.
CREATE FUNCTION events_horizon() RETURNS xid8 LANGUAGE sql STABLE AS $$
    WITH snapshot AS MATERIALIZED (SELECT pg_current_snapshot() AS s),
         locks AS MATERIALIZED (
        SELECT locktype, pid, transactionid::text::bigint AS xid, classid, objid, objsubid
          FROM pg_locks
         WHERE granted
           AND (locktype = 'transactionid' AND mode = 'ExclusiveLock'
                OR locktype = 'advisory' AND classid = 1146045283
                   AND objid = 'events'::regclass::oid AND objsubid = 2)),
         open AS (
        SELECT x FROM snapshot, pg_snapshot_xip(s) AS x)
    SELECT coalesce(min(o.x), (SELECT pg_snapshot_xmax(s) FROM snapshot))
      FROM open o
     WHERE NOT EXISTS (
           SELECT 1
             FROM locks t
            WHERE t.locktype = 'transactionid'
              AND t.xid = o.x::text::bigint % 4294967296
              AND NOT EXISTS (SELECT 1 FROM locks a
                               WHERE a.locktype = 'advisory' AND a.pid = t.pid))
$$;
