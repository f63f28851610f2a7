"""The pure core of a turn, table-driven: end decisions, and the state folded from events."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from actors.turn.core import (
    Continue,
    End,
    Limits,
    RunTools,
    TurnState,
    after_model,
    after_tools,
    fold,
    remaining_output,
    repair_outcome,
    unanswered_tool_uses,
)
from eventstore import Metadata, RecordedEvent
from eventstore.catalogue import ModelResult, ToolCall, ToolRepair, ToolResult, TurnStart
from eventstore.event import Event

LIMITS = Limits(max_steps=3, max_output_tokens=100)
TOOL = {"type": "tool_use", "id": "toolu_1", "name": "calculator", "input": {"expression": "1"}}
TEXT = {"type": "text", "text": "hi"}


def recorded(events: list[Event]) -> list[RecordedEvent]:
    meta = Metadata(agent_id="a", session_key="k", turn_id="t1")
    return [
        RecordedEvent("turn-t1", i, i + 1, 9, uuid.uuid4(), e.TYPE, e, meta, datetime.now(UTC))
        for i, e in enumerate(events)
    ]


def result(
    content: list[dict[str, Any]], output: int = 10, finish: str = "end_turn"
) -> ModelResult:
    text = "".join(b.get("text", "") for b in content)
    return ModelResult(output_tokens=output, prompt_tokens=50, finish_reason=finish, latency_ms=1,
                       text=text, content=content)  # fmt: skip


@pytest.mark.parametrize(
    ("content", "stop", "steps", "output", "expected"),
    [
        ([TEXT], "end_turn", 1, 10, "final"),
        ([TEXT], "stop_sequence", 1, 10, "final"),
        ([TEXT], "max_tokens", 1, 10, "truncated"),  # one call's limit: the reply is cut off
        ([TEXT, TOOL], "max_tokens", 1, 10, "truncated"),  # a cut-off call never runs
        ([TEXT], "max_tokens", 1, 100, "output_limit"),  # the turn's own budget is spent
        ([TEXT, TOOL], "tool_use", 1, 10, RunTools),
        ([TEXT, TOOL], "tool_use", 1, 100, "output_limit"),  # the turn's budget is spent
        ([TEXT], "refusal", 1, 10, "refused"),
        ([TEXT], "model_context_window_exceeded", 1, 10, "error"),
        ([TEXT], "pause_turn", 1, 10, RunTools),  # continue the paused reply
        ([TEXT], "pause_turn", 3, 10, "max_steps"),
    ],
)
def test_after_model(content: list[dict[str, Any]], stop: str, steps: int, output: int,
                     expected: str | type) -> None:  # fmt: skip
    state = TurnState(steps=steps, output_tokens=output)
    decided = after_model(state, content, stop, LIMITS)
    if isinstance(expected, str):
        assert isinstance(decided, End)
        assert decided.reason == expected
        assert decided.reason == "final" or decided.error is not None
    else:
        assert isinstance(decided, expected)


@pytest.mark.parametrize(("steps", "expected"), [(1, Continue), (2, Continue), (3, End)])
def test_after_tools_caps_steps(steps: int, expected: type) -> None:
    assert isinstance(after_tools(TurnState(steps=steps), LIMITS), expected)


def test_one_repair_round_then_failure() -> None:
    invalid = {"toolu_1": ["expression: 'expression' is a required property"]}
    assert repair_outcome(TurnState(repairs=0), invalid) is None
    ended = repair_outcome(TurnState(repairs=1), invalid)
    assert ended is not None and ended.error is not None
    assert ended.error.code == "tool_repair_failed"
    assert repair_outcome(TurnState(repairs=1), {}) is None


def test_each_call_asks_for_what_is_left_of_the_turns_output_budget() -> None:
    assert remaining_output(TurnState(output_tokens=30), LIMITS, per_call=1000) == 70
    assert remaining_output(TurnState(output_tokens=0), LIMITS, per_call=40) == 40
    assert remaining_output(TurnState(output_tokens=500), LIMITS, per_call=40) == 1


def test_fold_rebuilds_the_transcript_open_calls_and_usage() -> None:
    events: list[Event] = [
        TurnStart(source="api", input="1+1?"),
        result([TEXT, TOOL], finish="tool_use"),
        ToolCall(slug="calculator", call_id="toolu_1", args_hash="x", mutating=False,
                 args={"expression": "1"}),
    ]  # fmt: skip
    state = fold(recorded(events))
    assert (state.input, state.steps, state.output_tokens, state.version) == ("1+1?", 1, 10, 2)
    assert [c.call_id for c in state.open_calls] == ["toolu_1"]
    assert unanswered_tool_uses(state) == [TOOL]
    events.append(ToolResult(slug="calculator", call_id="toolu_1", ok=True, latency_ms=1,
                             bytes=1, output="1"))  # fmt: skip
    events.append(ToolRepair(slugs=["x"], errors=["e"]))
    state = fold(recorded(events))
    assert state.open_calls == ()
    assert unanswered_tool_uses(state) == []
    assert state.repairs == 1
    assert state.transcript[-1] == {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1", "is_error": False}
    ]}  # fmt: skip
