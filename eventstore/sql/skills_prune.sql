-- Versions of an agent's skills that no node has loaded for a week (a node still running an
-- older version stamps it at each start, and a turn resumed reads its version within minutes).
DELETE FROM skills
 WHERE agent_id = %(agent_id)s
   AND loaded_at < now() - interval '7 days'
   AND (skill_id, digest) NOT IN (SELECT * FROM unnest(%(ids)s::text[], %(digests)s::text[]))
