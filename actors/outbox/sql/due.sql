-- Items to send now: pending, due, and at the head of their reply (every earlier chunk is sent,
-- or settled as uncertain); on an ordered channel (a chat), also at the head of their
-- recipient's line (no earlier item to the same recipient is still to be sent; a failed one
-- does not hold the line). Items this node holds already are left out by id, and channels it
-- has enough of in hand by (agent, channel): a slow channel's backlog must not fill the read-
-- ahead and starve the others.
SELECT o.item_id, o.agent_id, o.session_key, o.turn_id, o.channel_id, o.recipient, o.thread,
       o.chunk_index, o.chunk_total, o.body, o.status, o.attempts, o.uncertain, o.version
  FROM outbox o
 WHERE o.status = 'pending'
   AND o.next_attempt_at <= now()
   AND o.item_id <> ALL(%(busy)s::text[])
   AND o.agent_id || '/' || o.channel_id <> ALL(%(full)s::text[])
   AND NOT EXISTS (SELECT 1
                     FROM outbox p
                    WHERE p.group_key = o.group_key
                      AND p.chunk_index < o.chunk_index
                      AND p.status NOT IN ('sent', 'uncertain'))
   AND (NOT o.ordered
        OR NOT EXISTS (SELECT 1
                         FROM outbox p
                        WHERE p.ordered
                          AND p.status IN ('pending', 'inflight')
                          AND p.agent_id = o.agent_id
                          AND p.channel_id = o.channel_id
                          AND p.recipient = o.recipient
                          AND p.thread IS NOT DISTINCT FROM o.thread
                          AND p.position < o.position))
 ORDER BY o.next_attempt_at, o.item_id
 LIMIT %(limit)s
