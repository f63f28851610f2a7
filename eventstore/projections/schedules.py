"""The schedules projection: each schedule's definition and where its scheduler got to."""

from __future__ import annotations

from collections.abc import Iterable

from psycopg.types.json import Jsonb

from eventstore.catalogue import ScheduleDefined, ScheduleFired, ScheduleRemoved, ScheduleSkipped
from eventstore.envelope import RecordedEvent
from eventstore.projector import Statement


class SchedulesProjection:
    name: str = "schedules"
    tables: tuple[str, ...] = ("schedules",)
    types: frozenset[str] = frozenset(
        {ScheduleDefined.TYPE, ScheduleRemoved.TYPE, ScheduleFired.TYPE, ScheduleSkipped.TYPE}
    )

    def statements(self, event: RecordedEvent) -> Iterable[Statement]:
        agent, at, version = event.metadata.agent_id or "", event.recorded_at, event.version
        match event.data:
            case ScheduleDefined(schedule_id=sid, spec=spec, owner=owner):
                return [
                    (
                        """INSERT INTO schedules (agent_id, schedule_id, spec, owner, enabled,
                                                  created_at, updated_at, version)
                           VALUES (%s, %s, %s, %s, %s, %s, %s, %s)
                           ON CONFLICT (agent_id, schedule_id) DO UPDATE
                              SET spec = excluded.spec, owner = excluded.owner,
                                  enabled = excluded.enabled, updated_at = excluded.updated_at,
                                  version = excluded.version""",
                        [agent, sid, Jsonb(spec), owner, bool(spec.get("enabled", True)), at, at,
                         version],
                    )
                ]  # fmt: skip
            case ScheduleRemoved(schedule_id=sid):
                return [
                    (
                        "DELETE FROM schedules WHERE agent_id = %s AND schedule_id = %s",
                        [agent, sid],
                    )
                ]
            case ScheduleFired(schedule_id=sid, due=due, turn_id=turn_id, manual=manual):
                # A manual run does not move the schedule's clock.
                return [
                    (
                        """UPDATE schedules SET fired = fired + 1, last_fired_at = %s,
                                  last_turn_id = %s, version = %s,
                                  last_due = CASE WHEN %s THEN last_due
                                                  ELSE greatest(last_due, %s::timestamptz) END
                            WHERE agent_id = %s AND schedule_id = %s""",
                        [at, turn_id, version, manual, due or None, agent, sid],
                    )
                ]
            case ScheduleSkipped(schedule_id=sid, missed=missed) as e:
                return [
                    (
                        """UPDATE schedules SET skipped = skipped + %s, version = %s,
                                  last_due = greatest(last_due, %s::timestamptz)
                            WHERE agent_id = %s AND schedule_id = %s""",
                        [missed, version, e.up_to or None, agent, sid],
                    )
                ]
        return []
