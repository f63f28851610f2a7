"""The approvals projection: tool calls waiting for a person's answer, and the answers."""

from __future__ import annotations

from collections.abc import Iterable

from eventstore.catalogue import ApprovalRequested, ApprovalResolved
from eventstore.envelope import RecordedEvent
from eventstore.projector import Statement


class ApprovalsProjection:
    name: str = "approvals"
    tables: tuple[str, ...] = ("approvals",)
    types: frozenset[str] = frozenset({ApprovalRequested.TYPE, ApprovalResolved.TYPE})

    def statements(self, event: RecordedEvent) -> Iterable[Statement]:
        meta, at = event.metadata, event.recorded_at
        match event.data:
            case ApprovalRequested() as asked:
                return [
                    (
                        """INSERT INTO approvals (approval_id, agent_id, session_key, turn_id,
                                  call_id, slug, mutating, reason, status, requested_at,
                                  expires_at)
                           VALUES (%s, %s, %s, %s, %s, %s, %s, %s, 'pending', %s,
                                   nullif(%s, '')::timestamptz)
                           ON CONFLICT (approval_id) DO NOTHING""",
                        [asked.approval_id, meta.agent_id or "", meta.session_key or "",
                         meta.turn_id or "", asked.call_id, asked.slug, asked.mutating,
                         asked.reason, at, asked.expires_at],
                    )
                ]  # fmt: skip
            case ApprovalResolved() as answer:
                return [
                    (
                        """UPDATE approvals SET status = %s, resolved_at = %s, resolved_by = %s
                            WHERE approval_id = %s AND status = 'pending'""",
                        ["granted" if answer.granted else "denied", at, answer.by,
                         answer.approval_id],
                    )
                ]  # fmt: skip
        return []
