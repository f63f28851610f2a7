-- API keys (issue 37): credentials minted over the API, not events. A key is configuration of
-- who may call the API, not a fact of any agent's history: its revocation must take effect, its
-- last use is overwritten (coalesced, at most once a minute per node), and its salted hash stays
-- out of the log, the firehose and every replay. `digest` is HMAC-SHA256(salt, secret); the
-- secret itself is never stored. A revoked key keeps its row (revoked_at set): the list shows it,
-- and a node that has ever had a key stays closed on a token-less loopback bind.
CREATE TABLE api_keys (
    key_id       text        PRIMARY KEY,
    label        text        NOT NULL,
    scope        text        NOT NULL CHECK (scope IN ('read', 'chat', 'write', 'admin')),
    agents       text[],
    salt         bytea       NOT NULL,
    digest       bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    last_used_at timestamptz,
    revoked_at   timestamptz
);
