-- The versions of an agent's skills one node loaded: new ones inserted, known ones stamped as
-- loaded again (the prune below keeps what any node loaded lately). Pool connections are
-- autocommit: each statement commits on its own; two nodes indexing at once insert the same
-- rows, and ON CONFLICT makes the second a no-op rather than an error.
INSERT INTO skills (agent_id, skill_id, digest, title, description, body, tokens)
SELECT %(agent_id)s, s.skill_id, s.digest, s.title, s.description, s.body, s.tokens
  FROM unnest(%(ids)s::text[], %(digests)s::text[], %(titles)s::text[],
              %(descriptions)s::text[], %(bodies)s::text[], %(tokens)s::int[])
       AS s(skill_id, digest, title, description, body, tokens)
    ON CONFLICT (agent_id, skill_id, digest) DO UPDATE SET loaded_at = now()
