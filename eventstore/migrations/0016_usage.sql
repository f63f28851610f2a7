-- The usage meter: one row per model call, from its model.result (the usage projection,
-- inline), so that usage and cost over any range are a GROUP BY over an index range, not a
-- fold of the log. The turn's id and the result's version in the turn's stream are the key:
-- a retried or replayed append inserts nothing twice. `day` is the call's UTC date, what
-- budgets and `by=day` group on. Rows are never updated.
CREATE TABLE usage_calls (
    turn_id              text        NOT NULL,
    version              bigint      NOT NULL,
    agent_id             text        NOT NULL,
    session_key          text        NOT NULL,
    model                text,
    at                   timestamptz NOT NULL,
    day                  date        NOT NULL,
    prompt_tokens        bigint      NOT NULL DEFAULT 0,
    output_tokens        bigint      NOT NULL DEFAULT 0,
    cache_read_tokens    bigint      NOT NULL DEFAULT 0,
    cache_write_tokens   bigint      NOT NULL DEFAULT 0,
    server_tool_requests integer     NOT NULL DEFAULT 0,
    server_tools         jsonb       NOT NULL DEFAULT '{}',
    PRIMARY KEY (turn_id, version)
);
-- by day over the deployment, and one agent's day (its budget, GET /v1/agents/{agent}/usage)
CREATE INDEX usage_calls_at ON usage_calls (at);
CREATE INDEX usage_calls_agent_at ON usage_calls (agent_id, at);

-- Calls already in the log, metered as the projection would have: their model is not known
-- (model.result did not name it before this migration), so their cost is reported as unknown.
INSERT INTO usage_calls (turn_id, version, agent_id, session_key, model, at, day,
                         prompt_tokens, output_tokens, cache_read_tokens, cache_write_tokens,
                         server_tool_requests, server_tools)
SELECT substr(e.stream_id, 6), e.stream_version,
       coalesce(e.metadata->>'agentId', ''), coalesce(e.metadata->>'sessionKey', ''),
       e.data->>'model', e.recorded_at, (e.recorded_at AT TIME ZONE 'UTC')::date,
       coalesce((e.data->>'promptTokens')::bigint, 0),
       coalesce((e.data->>'outputTokens')::bigint, 0),
       coalesce((e.data->>'cacheReadTokens')::bigint, 0),
       coalesce((e.data->>'cacheWriteTokens')::bigint, 0),
       coalesce((SELECT sum(value::int) FROM jsonb_each_text(e.data->'serverToolRequests')), 0),
       coalesce(e.data->'serverToolRequests', '{}')
  FROM events e
 WHERE e.type = 'model.result' AND e.stream_id LIKE 'turn-%'
ON CONFLICT DO NOTHING;
