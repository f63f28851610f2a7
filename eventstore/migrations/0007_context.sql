-- Context assembly reads a session's history from its newest digest on (O(window), not
-- O(history)): turns are ordered by the position of their turn.start, and each session's
-- compaction view (its digest and the marks after it) is kept as one row.
ALTER TABLE turns ADD COLUMN start_position bigint;
UPDATE turns t
   SET start_position = (SELECT min(e.global_position) FROM events e
                          WHERE e.stream_id = 'turn-' || t.turn_id);
CREATE INDEX turns_session_start_idx ON turns (agent_id, session_key, start_position);
-- Each model call's usage, in order (prompt, output, cache read and write tokens): what prompt
-- caching saved shows per call, not only summed over the turn.
ALTER TABLE turns ADD COLUMN calls jsonb NOT NULL DEFAULT '[]';

-- The sticky compaction view of a session (inline: the next turn reads it right after the
-- append of the stage that changed it). `digest` stands for every turn up to its `through`
-- (a turn.start position); `marks` maps tool_use ids after it to excerpt | dedupe | stub.
CREATE TABLE session_context (
    agent_id    text   NOT NULL,
    session_key text   NOT NULL,
    digest      jsonb,
    marks       jsonb  NOT NULL DEFAULT '{}',
    position    bigint NOT NULL,
    PRIMARY KEY (agent_id, session_key)
);

-- artifact_read finds a tool result of a session by its tool_use id.
CREATE INDEX messages_tool_use_idx ON messages (agent_id, session_key, (content->>'tool_use_id'))
    WHERE role = 'tool';
