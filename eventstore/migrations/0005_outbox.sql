-- The outbox: one row per item (one chunk of one reply to one recipient), derived from the
-- item's delivery.* events (inline: the outbox actor reads it right after the append that
-- changed it). `version` is the item stream's version (-1 before its first event there): the
-- actor claims an item by appending delivery.attempted expecting that version, so two senders
-- never both claim it.
CREATE TABLE outbox (
    item_id             text        PRIMARY KEY,
    agent_id            text        NOT NULL,
    session_key         text        NOT NULL,
    turn_id             text        NOT NULL,
    channel_id          text        NOT NULL,
    recipient           text        NOT NULL,
    thread              text,
    group_key           text        NOT NULL,
    chunk_index         integer     NOT NULL,
    chunk_total         integer     NOT NULL,
    ordered             boolean     NOT NULL DEFAULT false,
    position            bigint      NOT NULL,
    -- position: the global position of the item's delivery.enqueued, its place in line
    body                text        NOT NULL,
    status              text        NOT NULL
        CHECK (status IN ('pending', 'inflight', 'sent', 'failed', 'uncertain')),
    attempts            integer     NOT NULL DEFAULT 0,
    next_attempt_at     timestamptz NOT NULL,
    uncertain           boolean     NOT NULL DEFAULT false,
    provider_message_id text,
    error_code          text,
    error               text,
    version             bigint      NOT NULL DEFAULT -1,
    node                text,
    -- the node of the last attempt: recovery tells a dead node's sends from a live one's
    created_at          timestamptz NOT NULL,
    updated_at          timestamptz NOT NULL
);

-- Due items: only unsettled rows are indexed, so the index stays the size of the backlog.
CREATE INDEX outbox_due_idx ON outbox (next_attempt_at, item_id)
    WHERE status IN ('pending', 'inflight');
-- Head of line: a chunk waits for its predecessor in the same reply, and on an ordered channel
-- (a chat) an item waits for every earlier unsettled item to the same recipient.
CREATE INDEX outbox_group_idx ON outbox (group_key, chunk_index);
CREATE INDEX outbox_line_idx ON outbox (agent_id, channel_id, recipient, position)
    WHERE ordered AND status IN ('pending', 'inflight');
-- The turn resource shows its deliveries.
CREATE INDEX outbox_turn_idx ON outbox (turn_id);

-- A turn's deliveries, one entry per recipient, as the turn resource shows them (the view keeps
-- the two queries that read it, one turn and a page of turns, from spelling it twice; a filter on
-- turn_id is pushed down into it).
CREATE VIEW turn_deliveries AS
SELECT turn_id,
       json_agg(json_build_object(
           'channel', channel_id, 'to', recipient, 'thread', thread, 'status', status,
           'chunks', chunks, 'sent', sent, 'attempts', attempts, 'uncertain', uncertain,
           'errorCode', error_code) ORDER BY channel_id, recipient, thread) AS deliveries
  FROM (SELECT turn_id, channel_id, recipient, thread,
               CASE WHEN bool_or(status = 'failed') THEN 'failed'
                    WHEN bool_and(status = 'sent') THEN 'sent'
                    WHEN bool_and(status IN ('sent', 'uncertain')) THEN 'uncertain'
                    WHEN bool_or(status = 'inflight') THEN 'sending'
                    ELSE 'pending' END AS status,
               count(*) AS chunks,
               count(*) FILTER (WHERE status = 'sent') AS sent,
               max(attempts) AS attempts,
               bool_or(uncertain) AS uncertain,
               min(error_code) FILTER (WHERE status = 'failed'
                                        AND error_code <> 'delivery_chunk_abandoned') AS error_code
          FROM outbox
         GROUP BY turn_id, channel_id, recipient, thread) per_recipient
 GROUP BY turn_id;

-- Schedules: the definition and where the scheduler is (derived from schedule-* streams).
CREATE TABLE schedules (
    agent_id     text        NOT NULL,
    schedule_id  text        NOT NULL,
    spec         jsonb       NOT NULL,
    owner        text        NOT NULL,
    enabled      boolean     NOT NULL,
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    last_due     timestamptz,
    last_fired_at timestamptz,
    last_turn_id text,
    fired        integer     NOT NULL DEFAULT 0,
    skipped      integer     NOT NULL DEFAULT 0,
    version      bigint      NOT NULL,
    PRIMARY KEY (agent_id, schedule_id)
);
