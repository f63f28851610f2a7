-- The outbox items this node is sending now (claimed by its last delivery.attempted).
SELECT count(*) FROM outbox WHERE status = 'inflight' AND node = %(node)s
