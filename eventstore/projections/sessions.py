"""The sessions and messages read models: each session's summary, and the history its next
turn reads (what the model was told and answered, in order)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb

from eventstore.catalogue import (
    ModelResult,
    PhaseChanged,
    SessionCleared,
    SessionForked,
    ToolResult,
    TurnEnd,
    TurnStart,
)
from eventstore.envelope import RecordedEvent
from eventstore.event import Event, UnknownEvent
from eventstore.projector import Statement


class SessionsProjection:
    """Sessions of each agent: how many turns, the last one, when last active or cleared, the
    session (and turn) it was forked from, and the phase it is in."""

    name: str = "sessions"
    tables: tuple[str, ...] = ("sessions",)
    types: frozenset[str] = frozenset(
        {TurnStart.TYPE, TurnEnd.TYPE, SessionCleared.TYPE, SessionForked.TYPE, PhaseChanged.TYPE}
    )

    def statements(self, event: RecordedEvent) -> Iterable[Statement]:
        agent, key = event.metadata.agent_id, event.metadata.session_key
        if agent is None or key is None:
            return []
        at = event.recorded_at
        match event.data:
            case TurnStart():
                return [
                    (
                        """INSERT INTO sessions (agent_id, session_key, turns, last_turn_id,
                                                 first_seen_at, last_activity_at)
                           VALUES (%s, %s, 1, %s, %s, %s)
                           ON CONFLICT (agent_id, session_key) DO UPDATE
                              SET turns = sessions.turns + 1,
                                  last_turn_id = excluded.last_turn_id,
                                  last_activity_at = excluded.last_activity_at""",
                        [agent, key, event.metadata.turn_id, at, at],
                    )
                ]
            case TurnEnd():
                return [
                    (
                        """UPDATE sessions SET last_activity_at = greatest(last_activity_at, %s)
                            WHERE agent_id = %s AND session_key = %s""",
                        [at, agent, key],
                    )
                ]
            case SessionCleared():
                return [
                    (
                        """INSERT INTO sessions (agent_id, session_key, first_seen_at,
                                                 last_activity_at, cleared_at)
                           VALUES (%s, %s, %s, %s, %s)
                           ON CONFLICT (agent_id, session_key) DO UPDATE
                              SET cleared_at = excluded.cleared_at,
                                  last_activity_at = excluded.last_activity_at,
                                  phase = NULL""",
                        [agent, key, at, at, at],
                    )
                ]
            case PhaseChanged(to=to):
                # A phase set before the session's first turn makes its row (turns 0).
                return [
                    (
                        """INSERT INTO sessions (agent_id, session_key, first_seen_at,
                                                 last_activity_at, phase)
                           VALUES (%s, %s, %s, %s, %s)
                           ON CONFLICT (agent_id, session_key) DO UPDATE
                              SET phase = excluded.phase""",
                        [agent, key, at, at, to],
                    )
                ]
            case SessionForked() as forked:
                origin = {
                    "agentId": forked.source_agent_id,
                    "sessionKey": forked.source_session_key,
                    "turnId": forked.at_turn_id,
                }
                return [
                    (
                        """INSERT INTO sessions (agent_id, session_key, first_seen_at,
                                                 last_activity_at, forked_from)
                           VALUES (%s, %s, %s, %s, %s)
                           ON CONFLICT (agent_id, session_key) DO UPDATE
                              SET forked_from = excluded.forked_from,
                                  last_activity_at = greatest(sessions.last_activity_at,
                                                              excluded.last_activity_at)""",
                        [agent, key, at, at, Jsonb(origin)],
                    )
                ]  # fmt: skip
            case _:
                return []


def history_row(event: Event | UnknownEvent) -> tuple[str, Any] | None:
    """The history row an event adds to its session (role, content blocks), if any. The messages
    projection stores these; a session actor that keeps its history in memory builds the same
    rows from the same events (actors/turn/runner.py), so both give the model the same context."""
    match event:
        case TurnStart(input=text):
            return ("user", {"type": "text", "text": text})
        case ModelResult(content=content) if content:
            return ("assistant", content)
        case ToolResult(server=False) as result:  # a server tool's result is in the reply
            return (
                "tool",
                {
                    "type": "tool_result",
                    "tool_use_id": result.call_id,
                    "content": result.content or result.output or "",
                    "is_error": not result.ok and not result.refused,
                },
            )
    return None


class MessagesProjection:
    """Session history: the person's input, the model's messages and tool results, in order.

    ``content`` rows are Anthropic content blocks: a user row holds one text block, an assistant
    row the blocks the model sent, a tool row one ``tool_result`` block. A cleared session drops
    its rows (the events stay in the log). A forked session starts with the rows its
    ``session.forked`` copied, at their source positions and with their source turns (the key
    is the session's, so they clash with nothing; history reads order them by their turns'
    ``turn.start``, which come before any turn of the new session).
    """

    name: str = "messages"
    tables: tuple[str, ...] = ("messages",)
    types: frozenset[str] = frozenset(
        {TurnStart.TYPE, ModelResult.TYPE, ToolResult.TYPE, SessionCleared.TYPE,
         SessionForked.TYPE}
    )  # fmt: skip

    def statements(self, event: RecordedEvent) -> Iterable[Statement]:
        meta = event.metadata
        if meta.agent_id is None or meta.session_key is None:
            return []
        if isinstance(event.data, SessionCleared):
            return [
                (
                    "DELETE FROM messages WHERE agent_id = %s AND session_key = %s",
                    [meta.agent_id, meta.session_key],
                )
            ]
        if isinstance(event.data, SessionForked):
            return _forked_rows(meta.agent_id, meta.session_key, event.data, event.recorded_at)
        row = history_row(event.data)
        if row is None or meta.turn_id is None:
            return []
        role, content_value = row
        return [
            (
                """INSERT INTO messages (agent_id, session_key, position, turn_id, role, content,
                                         recorded_at)
                   VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING""",
                [meta.agent_id, meta.session_key, event.position, meta.turn_id, role,
                 Jsonb(content_value), event.recorded_at],
            )
        ]  # fmt: skip


def _forked_rows(
    agent_id: str, session_key: str, forked: SessionForked, at: datetime
) -> list[Statement]:
    """The copied rows in one statement, however many there are (one round trip in the writer's
    transaction, not one per row)."""
    if not forked.messages:
        return []
    rows = [{"position": m.position, "turn_id": m.turn_id, "role": m.role, "content": m.content}
            for m in forked.messages]  # fmt: skip
    return [
        (
            """INSERT INTO messages (agent_id, session_key, position, turn_id, role, content,
                                     recorded_at)
               SELECT %s, %s, r.position, r.turn_id, r.role, r.content, %s
                 FROM jsonb_to_recordset(%s) AS r(position bigint, turn_id text, role text,
                                                  content jsonb)
               ON CONFLICT DO NOTHING""",
            [agent_id, session_key, at, Jsonb(rows)],
        )
    ]
