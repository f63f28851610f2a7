-- The skills (of the versions this node loaded) whose title or description shares a word with
-- the query, best first: ts_rank_cd weighs a title match (A) over a description match (B) and
-- words found close together over scattered ones. The tie-break on the id keeps the order the
-- same on every node.
SELECT s.skill_id, ts_rank_cd(s.document, q)::float8 AS rank
  FROM skills s, websearch_to_tsquery('english', %(query)s) AS q
 WHERE s.agent_id = %(agent_id)s
   AND (s.skill_id, s.digest) IN (SELECT * FROM unnest(%(ids)s::text[], %(digests)s::text[]))
   AND s.document @@ q
 ORDER BY rank DESC, s.skill_id
 LIMIT %(limit)s
