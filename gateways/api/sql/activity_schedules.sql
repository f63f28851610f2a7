-- Every enabled schedule, for the next wake-up (computed from the spec, as the schedule's own
-- resource computes next_due).
SELECT spec::text, created_at, last_due FROM schedules WHERE enabled
