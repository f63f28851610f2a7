"""Turns end to end with the offline scripted model: NATS ingress → session actor → turn actor →
model → tools → events, on real Postgres and NATS."""

from __future__ import annotations

import msgspec
import pytest

from eventstore import subjects
from eventstore.catalogue import ModelResult, ToolCall, ToolResult, TurnEnd
from tests.conftest import NodeFactory
from tests.turns import send, turn_row, types, wait_end


@pytest.mark.asyncio
async def test_the_default_agent_answers_offline_and_says_so(node_factory: NodeFactory) -> None:
    node = await node_factory.start()
    accepted = await send(node, "assistant", "hello there")
    assert accepted.session_key == "api:default"
    events = await wait_end(node, accepted.turn_id)
    assert types(events) == [
        "turn.start", "model.call", "model.chunk", "model.result", "turn.end",
    ]  # fmt: skip
    end = events[-1].data
    assert isinstance(end, TurnEnd)
    assert end.reason == "final"
    assert "[scripted model, offline]" in end.text and "hello there" in end.text
    row = await turn_row(node, accepted.turn_id)
    assert row["status"] == "final" and row["steps"] == 1 and row["text"] == end.text


@pytest.mark.asyncio
async def test_a_tool_step_runs_the_tool_and_feeds_the_result_back(
    node_factory: NodeFactory,
) -> None:
    node = await node_factory.start()
    accepted = await send(node, "assistant", "calculate 6*7")
    events = await wait_end(node, accepted.turn_id)
    calls = [e.data for e in events if isinstance(e.data, ToolCall)]
    results = [e.data for e in events if isinstance(e.data, ToolResult)]
    assert [c.slug for c in calls] == ["calculator"]
    assert calls[0].args == {"expression": "6*7"}
    assert results[0].ok and results[0].output == "42"
    end = events[-1].data
    assert isinstance(end, TurnEnd) and end.reason == "final" and end.steps == 2
    assert "42" in end.text


@pytest.mark.asyncio
async def test_session_notes_persist_across_turns(node_factory: NodeFactory) -> None:
    node = await node_factory.start()
    first = await send(node, "assistant", "remember: the door code is 1234", session="s1")
    await wait_end(node, first.turn_id)
    second = await send(node, "assistant", "what are my notes?", session="s1")
    events = await wait_end(node, second.turn_id)
    results = [e.data for e in events if isinstance(e.data, ToolResult)]
    assert "the door code is 1234" in (results[0].output or "")
    # The second turn's model call saw the first turn in its history.
    model_results = [e.data for e in events if isinstance(e.data, ModelResult)]
    assert model_results


@pytest.mark.asyncio
async def test_malformed_commands_on_internal_subjects_get_an_error_reply(
    node_factory: NodeFactory,
) -> None:
    node = await node_factory.start()
    assert node.nc is not None
    for subject in (subjects.node_command(node.node_id, k, 0) for k in ("submit", "stop")):
        for body in (b"not json", b'{"unexpected": true}'):
            answer = await node.nc.request(subject, body, timeout=5)
            error = msgspec.json.decode(answer.data)["error"]
            assert error["code"] == "invalid_command"
            assert error["hint"]
