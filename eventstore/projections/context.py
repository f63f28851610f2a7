"""The session context projection: each session's sticky compaction view (its newest digest and
the marks on the tool results after it), folded from ``compaction.stage``.

It names no rung (they are declared in actors/context/rungs.py, above this layer): a stage's
event says what it did. ``ids`` are the tool results a marking rung marked, each marked with the
stage's name; a stage that wrote a digest (``changed``, with its ``text``) replaces the view. A
test runs every rung of the registry through this fold."""

from __future__ import annotations

from collections.abc import Iterable

from psycopg.types.json import Jsonb

from eventstore.catalogue import CompactionStage, SessionCleared
from eventstore.envelope import RecordedEvent
from eventstore.projector import Statement


class SessionContextProjection:
    name: str = "session_context"
    tables: tuple[str, ...] = ("session_context",)
    types: frozenset[str] = frozenset({CompactionStage.TYPE, SessionCleared.TYPE})

    def statements(self, event: RecordedEvent) -> Iterable[Statement]:
        meta = event.metadata
        if meta.agent_id is None or meta.session_key is None:
            return []
        key = [meta.agent_id, meta.session_key]
        match event.data:
            case SessionCleared():
                return [("DELETE FROM session_context WHERE agent_id = %s AND session_key = %s",
                         key)]  # fmt: skip
            case CompactionStage(stage=stage, ids=ids) if ids:
                marks = Jsonb(dict.fromkeys(ids, stage))
                return [
                    (
                        """INSERT INTO session_context (agent_id, session_key, marks, position)
                           VALUES (%s, %s, %s, %s)
                           ON CONFLICT (agent_id, session_key) DO UPDATE
                              SET marks = session_context.marks || EXCLUDED.marks,
                                  position = EXCLUDED.position""",
                        [*key, marks, event.position],
                    )
                ]
            case CompactionStage(changed=True, text=str()) as done:
                digest = {"text": done.text, "source": done.digest or "mechanical",
                          "through": done.through or 0, "turns": done.turns,
                          "requests": done.requests or [], "archived": done.archived}  # fmt: skip
                return [
                    (
                        """INSERT INTO session_context (agent_id, session_key, digest, marks,
                                                        position)
                           VALUES (%s, %s, %s, %s, %s)
                           ON CONFLICT (agent_id, session_key) DO UPDATE
                              SET digest = EXCLUDED.digest, marks = EXCLUDED.marks,
                                  position = EXCLUDED.position""",
                        [*key, Jsonb(digest), Jsonb(done.kept or {}), event.position],
                    )
                ]
        return []
