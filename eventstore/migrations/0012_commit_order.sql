-- Appends commit in checkpoint order, so a reader needs no horizon (eventstore-notes 1.5).
--
-- Until now a reader stopped below the oldest running transaction of the whole cluster
-- (pg_snapshot_xmin): an event may commit after a later-numbered one, and only below that horizon
-- was a page final. Any transaction anywhere on the server (an idle psql session, a migration of
-- another database) then froze every live stream for as long as it stayed open.
--
-- Now every statement that inserts into the log first takes one transaction-scoped lock, before
-- its transaction has an id. Appending transactions therefore take their ids, insert and commit
-- one after another: a later one gets a larger id and cannot commit first. What a reader sees
-- of the log is always a prefix of it in (transaction_id, global_position) order, and whatever
-- commits later sorts after everything already visible, whoever else keeps a transaction open.
--
-- An append whose transaction already holds an id (it wrote something else first) would break
-- that order, so it is refused. The cost is one lock per append transaction; a node's writer
-- commits one batch at a time anyway, and several nodes take turns (their batches grow).
CREATE FUNCTION events_commit_order() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('dispach.appending', true) IS DISTINCT FROM 'on' THEN
        IF pg_current_xact_id_if_assigned() IS NOT NULL THEN
            RAISE EXCEPTION 'an append must be the first write of its transaction'
                USING ERRCODE = 'object_not_in_prerequisite_state',
                      HINT = 'append to the log before any other write of the transaction, '
                             'so appends commit in checkpoint order';
        END IF;
        -- Keyed by the table's oid: each schema's log has its own order.
        PERFORM pg_advisory_xact_lock(1146045283, TG_RELID::integer);
        PERFORM set_config('dispach.appending', 'on', true);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER events_commit_order
    BEFORE INSERT ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_commit_order();
