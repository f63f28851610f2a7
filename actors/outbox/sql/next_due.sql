-- When the outbox next has something to do, and how deep it is (the partial index covers both).
SELECT min(next_attempt_at) FILTER (WHERE status = 'pending')
           - now() AS wait,
       count(*) AS depth
  FROM outbox
 WHERE status IN ('pending', 'inflight')
