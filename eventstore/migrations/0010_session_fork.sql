-- The session (and turn) a session was forked from, as {agentId, sessionKey, turnId}; null for a
-- session that was not (set by `session.forked`, its first event). Sessions recorded before
-- this migration were not forked: null is their value, no rebuild needed.
ALTER TABLE sessions ADD COLUMN forked_from jsonb;
