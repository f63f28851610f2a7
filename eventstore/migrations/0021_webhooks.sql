-- Outbound event webhooks (issue 37). `webhooks` is a projection of webhook-* streams (inline:
-- the POST answers with the row). `created_txid`/`created_position` are the checkpoint of its
-- webhook.created: the fan-out delivers the events after it.
CREATE TABLE webhooks (
    webhook_id       text        PRIMARY KEY,
    url              text        NOT NULL,
    events           text[]      NOT NULL,
    agents           text[],
    description      text,
    created_at       timestamptz NOT NULL,
    deleted_at       timestamptz,
    created_txid     bigint      NOT NULL,
    created_position bigint      NOT NULL,
    version          bigint      NOT NULL
);
-- The signing secrets: configuration, not history (as api_keys): never in the log, so never in
-- a replay, the firehose or an archive; not a projection, so a rebuild keeps them.
CREATE TABLE webhook_secrets (
    webhook_id text PRIMARY KEY,
    secret     text NOT NULL
);
-- How far the fan-out has read the log for each subscription. Only a shortcut: its appends are
-- idempotent (derived event ids), so a cursor behind the truth re-reads, never re-promises.
CREATE TABLE webhook_cursors (
    webhook_id text   PRIMARY KEY,
    txid       bigint NOT NULL,
    position   bigint NOT NULL
);
-- Which event each webhook delivery carries (a projection of webhookfeed-* streams' delivery.
-- enqueued): the outbox row says where the item stands, this what it is.
CREATE TABLE webhook_deliveries (
    item_id    text   PRIMARY KEY,
    webhook_id text   NOT NULL,
    event_id   text   NOT NULL,
    event_type text   NOT NULL,
    cursor     text   NOT NULL,
    position   bigint NOT NULL
);
CREATE INDEX webhook_deliveries_idx ON webhook_deliveries (webhook_id, position DESC);
