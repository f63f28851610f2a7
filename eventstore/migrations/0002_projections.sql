-- Checkpoints of asynchronous projections, written in the same transaction as their rows.
CREATE TABLE projection_checkpoints (
    name        text        PRIMARY KEY,
    txid        bigint      NOT NULL,
    position    bigint      NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- The turn resource (inline: a caller reads it right after the append that changed it).
CREATE TABLE turns (
    turn_id            text        PRIMARY KEY,
    agent_id           text        NOT NULL,
    session_key        text        NOT NULL,
    source             text        NOT NULL,
    input              text        NOT NULL,
    status             text        NOT NULL,
    state              text        NOT NULL,
    steps              integer     NOT NULL DEFAULT 0,
    attempt            integer     NOT NULL DEFAULT 0,
    prompt_tokens      integer     NOT NULL DEFAULT 0,
    output_tokens      integer     NOT NULL DEFAULT 0,
    cache_read_tokens  integer     NOT NULL DEFAULT 0,
    cache_write_tokens integer     NOT NULL DEFAULT 0,
    text               text        NOT NULL DEFAULT '',
    error_code         text,
    error_message      text,
    error_hint         text,
    started_at         timestamptz NOT NULL,
    ended_at           timestamptz,
    duration_ms        integer,
    last_position      bigint      NOT NULL
);

CREATE INDEX turns_session_idx ON turns (agent_id, session_key, started_at DESC);
CREATE INDEX turns_status_idx ON turns (agent_id, status, started_at DESC);

-- Sessions (asynchronous: nobody needs it in the same instant as the append).
CREATE TABLE sessions (
    agent_id         text        NOT NULL,
    session_key      text        NOT NULL,
    turns            integer     NOT NULL DEFAULT 0,
    last_turn_id     text,
    first_seen_at    timestamptz NOT NULL,
    last_activity_at timestamptz NOT NULL,
    cleared_at       timestamptz,
    PRIMARY KEY (agent_id, session_key)
);
