-- An agent's deliveries, newest first (GET /v1/agents/{agent}/deliveries): the outbox keeps
-- every item it settled, so without this the page would read the whole table.
CREATE INDEX outbox_agent_idx ON outbox (agent_id, position DESC);
