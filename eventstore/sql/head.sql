-- The version of a stream's last event, live or archived (events_heads, migration 0014).
SELECT head FROM events_heads(ARRAY[%(stream)s::text]) WHERE head IS NOT NULL
