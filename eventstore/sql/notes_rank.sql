-- A session's notes ranked against the query the way skills are (the same text search
-- configuration, the same ranking), computed on the fly: a session's notes are few and live in
-- its stream, so they need no index of their own. `index` counts from 0, in the notes' order.
SELECT (n.ord - 1)::int AS index, ts_rank_cd(to_tsvector('english', n.note), q)::float8 AS rank
  FROM unnest(%(notes)s::text[]) WITH ORDINALITY AS n(note, ord),
       websearch_to_tsquery('english', %(query)s) AS q
 WHERE to_tsvector('english', n.note) @@ q
 ORDER BY rank DESC, n.ord
 LIMIT %(limit)s
