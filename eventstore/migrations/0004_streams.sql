-- Live streams and replays of one turn read the turn's events by id: its own stream and, later,
-- delivery events of other streams that carry its turnId. The checkpoint columns follow so a
-- resumed read pages in log order without a sort.
CREATE INDEX events_turn_idx ON events ((metadata->>'turnId'), transaction_id, global_position)
    WHERE metadata ? 'turnId';

-- When a history row was recorded (the event's recorded_at), for the session history API.
ALTER TABLE messages ADD COLUMN recorded_at timestamptz;
