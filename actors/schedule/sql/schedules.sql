-- Every schedule of the agents this node runs, with where its clock is.
SELECT agent_id, schedule_id, spec::text, owner, enabled, created_at, last_due, version
  FROM schedules
 WHERE agent_id = ANY(%(agents)s::text[])
 ORDER BY agent_id, schedule_id
