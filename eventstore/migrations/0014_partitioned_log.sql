-- The log becomes a table partitioned by range of global_position (eventstore/partitions.py), so
-- that old ranges can be archived whole and dropped (eventstore/archive.py) instead of deleted
-- row by row. Every row keeps its position, its transaction id and hence every cursor: the old
-- table becomes the first partition as it is, and positions go on from the same number.
--
-- What Postgres cannot keep: a unique constraint of a partitioned table must contain the
-- partition key, so (stream_id, stream_version) and event_id are unique only inside each
-- partition now (a local unique index on every partition, the safety net within one). Across
-- partitions the append statement (sql/append.sql) enforces both itself. Appends of different
-- nodes run concurrently (the append lock of 0012 is shared), so the statement first takes a
-- transaction-scoped advisory lock per stream of its batch (events_lock_streams, in one order:
-- two batches never wait for each other in a cycle), then reads the heads and the stored event
-- ids through the VOLATILE functions below, whose queries take a snapshot of their own after
-- those locks (the statement's snapshot is taken before the locks are granted, so an inline
-- subquery would not see the append of the same stream that committed while it waited), and
-- inserts nothing of a command that is not at its expected version or whose ids are stored in
-- any partition. A retry carries the ids of its first attempt in the same stream, so the
-- stream's lock orders it after that attempt too. global_position contains the key and stays
-- unique across the log.

ALTER TABLE events RENAME TO events_0;
ALTER TABLE events_0 RENAME CONSTRAINT events_pkey TO events_0_stream_version_key;
ALTER TABLE events_0 RENAME CONSTRAINT events_event_id_key TO events_0_event_id_key;
ALTER TABLE events_0 RENAME CONSTRAINT events_global_position_key TO events_0_position_key;
-- Inserts go through the parent, which takes the commit-order lock; a restored partition is
-- loaded before it is attached (eventstore/archive.py) and must not take it.
DROP TRIGGER events_commit_order ON events_0;
ALTER TRIGGER events_append_only ON events_0 RENAME TO events_0_append_only;

CREATE TABLE events (
    global_position bigint      GENERATED ALWAYS AS IDENTITY,
    stream_id       text        NOT NULL,
    stream_version  bigint      NOT NULL,
    event_id        uuid        NOT NULL,
    type            text        NOT NULL,
    data            jsonb       NOT NULL,
    metadata        jsonb       NOT NULL DEFAULT '{}',
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    transaction_id  xid8        NOT NULL DEFAULT pg_current_xact_id(),
    -- The old table's check, by its name: a partition must carry the parent's checks.
    CONSTRAINT events_stream_version_check CHECK (stream_version >= 0),
    CONSTRAINT events_global_position_key UNIQUE (global_position)
) PARTITION BY RANGE (global_position);

-- The old table's identity is dropped (with its sequence) after the new one continues from it.
-- The first partition ends right after the last stored position; the next ones are created by
-- eventstore/partitions.py before positions reach them.
DO $$
DECLARE
    last_position bigint := (SELECT coalesce(max(global_position), 0) FROM events_0);
BEGIN
    PERFORM setval(pg_get_serial_sequence('events', 'global_position'), greatest(last_position, 1),
                   last_position > 0);
    ALTER TABLE events_0 ALTER COLUMN global_position DROP IDENTITY;
    EXECUTE format('ALTER TABLE events ATTACH PARTITION events_0 FOR VALUES FROM (MINVALUE) TO (%s)',
                   last_position + 1);
END
$$;

-- Every other index of the old table (events_checkpoint_idx, events_turn_idx of 0004, the scoped
-- read indexes of 0013, any later one) becomes a partitioned index of the same definition on the
-- parent, with the old table's index attached as its first partition: nothing is rebuilt.
DO $$
DECLARE
    old record;
BEGIN
    FOR old IN
        SELECT c.relname AS name, pg_get_indexdef(i.indexrelid) AS def
          FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE i.indrelid = 'events_0'::regclass AND NOT i.indisunique
    LOOP
        EXECUTE format('ALTER INDEX %I RENAME TO %I', old.name, 'events_0_' ||
                       substr(old.name, length('events_') + 1));
        EXECUTE regexp_replace(old.def, ' ON (\S+\.)?events_0 ', ' ON ONLY \1events ');
        EXECUTE format('ALTER INDEX %I ATTACH PARTITION %I', old.name, 'events_0_' ||
                       substr(old.name, length('events_') + 1));
    END LOOP;
END
$$;

-- Append-only, on the parent (statements on the log) and on each partition (statements on one).
CREATE TRIGGER events_append_only
    BEFORE UPDATE OR DELETE OR TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change();
CREATE TRIGGER events_commit_order
    BEFORE INSERT ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_commit_order();

-- How the log is cut: partition k holds positions [k * size, (k + 1) * size) (the first one
-- everything below its end). One row; `ahead` partitions past the current one exist at all times.
CREATE TABLE log_partitioning (
    one   boolean PRIMARY KEY DEFAULT true CHECK (one),
    size  bigint  NOT NULL DEFAULT 1000000 CHECK (size >= 1),
    ahead integer NOT NULL DEFAULT 2 CHECK (ahead >= 1)
);
INSERT INTO log_partitioning DEFAULT VALUES;

-- Archived partitions (eventstore/archive.py). A row is written, and committed, before the
-- partition is detached: a read that could miss its events is refused (CursorArchived) from then
-- on. `last_txid`/`last_position` are the partition's last checkpoint in checkpoint order.
CREATE TABLE log_archives (
    archive_id     text        PRIMARY KEY,
    partition_name text        NOT NULL,
    lower_bound    bigint,
    upper_bound    bigint      NOT NULL,
    first_position bigint      NOT NULL,
    last_position  bigint      NOT NULL,
    last_txid      xid8        NOT NULL,
    event_count    bigint      NOT NULL,
    location       text        NOT NULL,
    manifest       jsonb       NOT NULL,
    archived_at    timestamptz NOT NULL DEFAULT now(),
    restored_at    timestamptz
);
CREATE UNIQUE INDEX log_archives_live_idx ON log_archives (partition_name) WHERE restored_at IS NULL;

-- The last version of every stream whose last event was archived: appends continue its versions
-- instead of starting it again at 0, and a read of it can tell archived from absent.
CREATE TABLE archived_heads (
    stream_id      text   PRIMARY KEY,
    stream_version bigint NOT NULL,
    archive_id     text   NOT NULL REFERENCES log_archives
);

-- The appends of a batch, one stream at a time: an exclusive transaction-scoped lock per stream,
-- taken in one order (by the hash the key is made of), so concurrent batches never wait for each
-- other in a cycle. Two streams of one hash share a lock: they only wait for each other.
CREATE FUNCTION events_lock_streams(streams text[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    key integer;
BEGIN
    FOR key IN SELECT DISTINCT hashtext(s) FROM unnest(streams) AS s ORDER BY 1 LOOP
        PERFORM pg_advisory_xact_lock(1146045284, key);
    END LOOP;
END
$$;

-- The head of each stream, live or archived. VOLATILE: in READ COMMITTED its query takes its own
-- snapshot when it runs, after the streams' locks when `locking` names them (the append does).
CREATE FUNCTION events_heads(streams text[], locking text[] DEFAULT NULL)
RETURNS TABLE (stream_id text, head bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF locking IS NOT NULL THEN
        PERFORM events_lock_streams(locking);
    END IF;
    RETURN QUERY
    SELECT s.stream_id,
           greatest((SELECT e.stream_version
                       FROM events e
                      WHERE e.stream_id = s.stream_id
                      ORDER BY e.stream_version DESC
                      LIMIT 1),
                    (SELECT a.stream_version FROM archived_heads a WHERE a.stream_id = s.stream_id))
      FROM unnest(streams) AS s(stream_id);
END
$$;

-- Which of these event ids are stored in any partition; VOLATILE and locking for the same reason
-- (a lock already held by the transaction is granted again at once).
CREATE FUNCTION events_stored(ids uuid[], locking text[] DEFAULT NULL) RETURNS SETOF uuid
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF locking IS NOT NULL THEN
        PERFORM events_lock_streams(locking);
    END IF;
    RETURN QUERY SELECT e.event_id FROM events e WHERE e.event_id = ANY(ids);
END
$$;
