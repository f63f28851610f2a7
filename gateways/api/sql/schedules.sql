SELECT schedule_id, spec::text, owner, created_at, updated_at, last_due, last_fired_at,
       last_turn_id, fired, skipped, version
  FROM schedules
 WHERE agent_id = %(agent)s AND (%(id)s::text IS NULL OR schedule_id = %(id)s)
 ORDER BY schedule_id
