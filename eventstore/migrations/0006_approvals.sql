-- Tool calls that asked for a person's approval, and the answers (inline: an approval is
-- listed, and answerable, the moment its request is committed).
CREATE TABLE approvals (
    approval_id  text        PRIMARY KEY,
    agent_id     text        NOT NULL,
    session_key  text        NOT NULL,
    turn_id      text        NOT NULL,
    call_id      text        NOT NULL,
    slug         text        NOT NULL,
    mutating     boolean     NOT NULL,
    reason       text        NOT NULL,
    status       text        NOT NULL CHECK (status IN ('pending', 'granted', 'denied')),
    requested_at timestamptz NOT NULL,
    expires_at   timestamptz,
    resolved_at  timestamptz,
    resolved_by  text
);

CREATE INDEX approvals_pending_idx ON approvals (agent_id, requested_at)
    WHERE status = 'pending';
