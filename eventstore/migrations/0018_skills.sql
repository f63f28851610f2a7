-- The skills index: an agent's skill files (markdown under its directory), as the node that
-- loaded them read them, for full-text ranking at the start of each turn. Not a projection of
-- the log: the files are the truth, and every node's start writes the versions it loaded.
-- A row is one version of one skill (`digest`: a hash of its file), so nodes that loaded
-- different versions (a rolling deploy) each rank their own, and a turn resumed after a crash
-- reads the very text its `skill.selected` chose. Versions no node has loaded for a week are
-- pruned at load.
CREATE TABLE skills (
    agent_id    text        NOT NULL,
    skill_id    text        NOT NULL,
    digest      text        NOT NULL,
    title       text        NOT NULL,
    description text        NOT NULL,
    body        text        NOT NULL,
    tokens      integer     NOT NULL,
    loaded_at   timestamptz NOT NULL DEFAULT now(),
    -- What a turn's words are matched against: the title weighs most, then the description.
    -- The body is the procedure the model follows, not what says when it applies.
    document    tsvector    GENERATED ALWAYS AS (
        setweight(to_tsvector('english', title), 'A')
        || setweight(to_tsvector('english', description), 'B')
    ) STORED,
    PRIMARY KEY (agent_id, skill_id, digest)
);
CREATE INDEX skills_document_idx ON skills USING gin (document);
