-- The phase a session is in (the last `phase.changed` of the session or of one of its turns;
-- NULL: the entry phase, as after `session.cleared`). A turn of a phased agent reads it when
-- it begins; GET …/sessions/{key} shows it.
ALTER TABLE sessions ADD COLUMN phase text;
