"""The usage meter: one row per model call, folded from its ``model.result`` (inline, so that
a budget check right after a turn sees the turn's calls). What the usage API and the budgets
sum: ``GET /v1/usage`` groups these rows, never the log."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC

from psycopg.types.json import Jsonb

from eventstore.catalogue import ModelResult
from eventstore.envelope import RecordedEvent
from eventstore.projector import Statement

_INSERT = """INSERT INTO usage_calls (turn_id, version, agent_id, session_key, model, at, day,
                                      prompt_tokens, output_tokens, cache_read_tokens,
                                      cache_write_tokens, server_tool_requests, server_tools)
             VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
             ON CONFLICT (turn_id, version) DO NOTHING"""


class UsageProjection:
    """A row per ``model.result`` of a turn's stream (a discarded reply's too: it was billed)."""

    name: str = "usage"
    tables: tuple[str, ...] = ("usage_calls",)
    types: frozenset[str] = frozenset({ModelResult.TYPE})

    def statements(self, event: RecordedEvent) -> Iterable[Statement]:
        result = event.data
        if not isinstance(result, ModelResult) or event.category != "turn":
            return []
        meta, at = event.metadata, event.recorded_at
        tools = {k: v for k, v in (result.server_tool_requests or {}).items() if v}
        return [
            (
                _INSERT,
                [
                    event.stream.split("-", 1)[1], event.version, meta.agent_id or "",
                    meta.session_key or "", result.model, at, at.astimezone(UTC).date(),
                    result.prompt_tokens, result.output_tokens, result.cache_read_tokens,
                    result.cache_write_tokens, sum(tools.values()), Jsonb(tools),
                ],
            )
        ]  # fmt: skip
