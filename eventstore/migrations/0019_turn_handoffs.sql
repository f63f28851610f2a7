-- The handoffs of a supervisor's turn (its handoff tool's calls), on the turn resource: one
-- entry per call, in the order the calls started, set by the turns projection from
-- handoff.start and completed by handoff.result. A constant default is only a catalogue change
-- (no table rewrite); turns older than this migration have none to show.
ALTER TABLE turns ADD COLUMN handoffs jsonb NOT NULL DEFAULT '[]';
