-- What the model thought during a turn (Dispach v1's `reasoning`, beside `text`): the texts of
-- the thinking blocks of the turn's model calls, set by the turns projection as each
-- model.result is appended. A constant default is only a catalogue change (no table rewrite).
-- Turns recorded before this migration read '' until `dispach projections rebuild turns`
-- replays their model.result events.
ALTER TABLE turns ADD COLUMN reasoning text NOT NULL DEFAULT '';
