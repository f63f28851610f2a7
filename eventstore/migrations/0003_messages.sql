-- Session history, as the model sees it: one row per message part, in log order (inline: the
-- next turn of a session reads it right after the previous turn's last append).
CREATE TABLE messages (
    agent_id    text   NOT NULL,
    session_key text   NOT NULL,
    position    bigint NOT NULL,
    turn_id     text   NOT NULL,
    role        text   NOT NULL CHECK (role IN ('user', 'assistant', 'tool')),
    content     jsonb  NOT NULL,
    PRIMARY KEY (agent_id, session_key, position)
);
