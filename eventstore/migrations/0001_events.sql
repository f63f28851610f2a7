-- The log. Every state Dispach serves is derived from these rows (DESIGN.md section 4).
CREATE TABLE events (
    global_position bigint      GENERATED ALWAYS AS IDENTITY,
    stream_id       text        NOT NULL,
    stream_version  bigint      NOT NULL CHECK (stream_version >= 0),
    event_id        uuid        NOT NULL,
    type            text        NOT NULL,
    data            jsonb       NOT NULL,
    metadata        jsonb       NOT NULL DEFAULT '{}',
    recorded_at     timestamptz NOT NULL DEFAULT now(),
    -- The id of the appending transaction: readers page by (transaction_id, global_position) and
    -- stop below the oldest running transaction, so an event that commits after a later-numbered
    -- one is never skipped (eventstore-notes 1.5).
    transaction_id  xid8        NOT NULL DEFAULT pg_current_xact_id(),
    -- Optimistic concurrency: two writers deciding from the same version collide here.
    PRIMARY KEY (stream_id, stream_version),
    -- Idempotent append: a retried command re-sends the same ids.
    CONSTRAINT events_event_id_key UNIQUE (event_id),
    CONSTRAINT events_global_position_key UNIQUE (global_position)
);

CREATE INDEX events_checkpoint_idx ON events (transaction_id, global_position);

-- Append-only: statement-level triggers refuse UPDATE, DELETE and TRUNCATE, even of zero rows.
CREATE FUNCTION events_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'events is append-only: % refused', TG_OP
        USING ERRCODE = 'restrict_violation',
              HINT = 'append a compensating event instead of changing history';
END
$$;

CREATE TRIGGER events_append_only
    BEFORE UPDATE OR DELETE OR TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION events_refuse_change();
