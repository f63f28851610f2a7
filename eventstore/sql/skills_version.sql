-- One version of one skill: what a turn that selected it reads when the node now has another.
SELECT title, body, tokens FROM skills
 WHERE agent_id = %(agent_id)s AND skill_id = %(skill_id)s AND digest = %(digest)s
