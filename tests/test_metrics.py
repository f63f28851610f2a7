"""Prometheus metrics: real turns on a real node move them by the right amounts, and
``GET /metrics`` serves them. The registry is process-wide and other tests run turns too, so
every check is a difference between two readings."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY
from starlette.applications import Starlette
from starlette.routing import Route

from eventstore import START, RecordedEvent
from eventstore.catalogue import TurnEnd
from gateways.http.metrics import STREAM_SUBSCRIBERS, metrics_endpoint
from runtime.node import Node
from tests import fakes
from tests.conftest import NodeFactory
from tests.fakes import FakeAnthropic, Reply, StreamFault
from tests.turns import send, stop, store_of, wait_end

fake_anthropic = fakes.fake_anthropic

Labels = dict[str, str]
# (name, sorted labels) -> value
Reading = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def read(*samples: tuple[str, Labels]) -> Reading:
    return {
        (name, tuple(sorted(labels.items()))): sample(name, **labels) for name, labels in samples
    }


def moved(before: Reading) -> Reading:
    """How much each sample of ``before`` has moved since."""
    return {key: sample(key[0], **dict(key[1])) - value for key, value in before.items()}


async def settled(node: Node) -> None:
    """Wait until the node's turn tasks are done: a test can see ``turn.end`` committed before the
    runner, woken by the same commit, has counted it."""
    assert node.engine is not None
    if node.engine.running:
        await asyncio.wait(set(node.engine.running), timeout=10)
    assert not node.engine.running


async def first_event(node: Node, turn_id: str, type_name: str) -> None:
    async for event in store_of(node).subscribe(START, where=lambda e: e.type == type_name):
        if event.metadata.turn_id == turn_id:
            return


def metered(slow_tool_path: Path) -> str:
    record_input = msgspec.json.encode({"path": str(slow_tool_path), "seconds": 3}).decode()
    return f"""
id: metered
model:
  provider: scripted
  script:
    - {{match: "^calc (.+)$", tool: calculator, input: {{expression: "{{1}}"}}}}
    - {{match: "^shout$", tool: shout, input: {{}}}}
    - {{match: "^wait$", tool: record, input: {record_input}}}
tools:
  - calculator
  - name: shout
    module: tests.fixtures_tools:shout
    description: Shouts its text (fails without one).
    input_schema: {{type: object}}
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran, then waits.
    mutating: true
    input_schema: {{type: object}}
"""


def end_reason(events: list[RecordedEvent]) -> str:
    end = events[-1].data
    assert isinstance(end, TurnEnd)
    return end.reason


@pytest.mark.asyncio
async def test_turns_move_the_turn_step_model_tool_and_append_metrics(
    node_factory: NodeFactory, tmp_path: Path
) -> None:
    slow = tmp_path / "runs.txt"
    node_factory.write_agent("metered", metered(slow))
    node = await node_factory.start()
    agent = {"agent": "metered"}
    turns = read(
        ("dispach_turns_ended_total", {**agent, "reason": "final"}),
        ("dispach_turns_ended_total", {**agent, "reason": "stopped"}),
        ("dispach_step_seconds_count", agent),
        ("dispach_model_call_seconds_count", {**agent, "outcome": "ok"}),
        ("dispach_model_call_seconds_count", {**agent, "outcome": "error"}),
        ("dispach_tool_call_seconds_count", {"tool": "calculator", "outcome": "ok"}),
        ("dispach_tool_call_seconds_count", {"tool": "shout", "outcome": "error"}),
        ("dispach_tool_call_seconds_count", {"tool": "record", "outcome": "ok"}),
        ("dispach_tool_call_seconds_count", {"tool": "record", "outcome": "error"}),
        ("dispach_turns_running", {}),
    )
    appends = read(
        ("dispach_append_seconds_count", {"outcome": "ok"}),
        ("dispach_append_seconds_count", {"outcome": "error"}),
        ("dispach_append_batch_commands_count", {}),
        ("dispach_append_batch_commands_sum", {}),
        ("dispach_events_appended_total", {}),
    )
    stored_before = len(await store_of(node).aread_all(START, limit=10_000))

    # One step, no tools; two steps with a tool that answers; two steps with a tool that fails.
    reasons = []
    for text in ("hello", "calc 6*7", "shout"):
        accepted = await send(node, "metered", text, session=f"api:{text}")
        reasons.append(end_reason(await wait_end(node, accepted.turn_id)))
    assert reasons == ["final", "final", "final"]
    # A turn stopped while its (mutating) tool runs: its step never completes.
    accepted = await send(node, "metered", "wait", session="api:wait")
    await asyncio.wait_for(first_event(node, accepted.turn_id, "tool.call"), 10)
    assert sample("dispach_turns_running") - turns[("dispach_turns_running", ())] == 1
    assert node.nc is not None
    await stop(node, accepted.turn_id)
    assert end_reason(await wait_end(node, accepted.turn_id)) == "stopped"
    await settled(node)

    assert list(moved(turns).values()) == [
        3, 1,  # turns ended: final, stopped
        5,  # steps: 1 + 2 + 2; the stopped turn's step never completed
        6, 0,  # model calls: ok, error
        1, 1,  # calculator ok, shout error
        0, 0,  # the stopped call is closed as cancelled, not timed as a tool call
        0,  # no turn left running
    ]  # fmt: skip
    ok, error, batches, commands, events = moved(appends).values()
    stored = len(await store_of(node).aread_all(START, limit=10_000)) - stored_before
    assert events == stored > 0  # every event this node committed, once
    assert ok == commands and error == 0  # each command answered once, in one batch
    assert 0 < batches <= commands


@pytest.mark.asyncio
async def test_a_failing_model_is_an_error_outcome_and_an_error_turn(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISPACH_TEST_ANTHROPIC_KEY", "test-key")
    node_factory.write_agent("failing", f"""
id: failing
model: {{provider: anthropic, base_url: "{fake_anthropic.url}",
         api_key_env: DISPACH_TEST_ANTHROPIC_KEY}}
""")  # fmt: skip
    fake_anthropic.script(StreamFault(Reply(text="halfway there"), after_events=5, kind="error"))
    node = await node_factory.start()
    agent = {"agent": "failing"}
    before = read(
        ("dispach_turns_ended_total", {**agent, "reason": "error"}),
        ("dispach_model_call_seconds_count", {**agent, "outcome": "error"}),
        ("dispach_model_call_seconds_count", {**agent, "outcome": "ok"}),
        ("dispach_step_seconds_count", agent),
    )
    accepted = await send(node, "failing", "hi")
    assert end_reason(await wait_end(node, accepted.turn_id)) == "error"
    await settled(node)
    # The step was cut short by the error, so it is not timed.
    assert list(moved(before).values()) == [1, 1, 0, 0]


@pytest.mark.asyncio
async def test_the_endpoint_serves_every_layer_in_the_prometheus_format() -> None:
    app = Starlette(routes=[Route("/metrics", metrics_endpoint)])
    STREAM_SUBSCRIBERS.labels(kind="ws").inc()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            response = await client.get("/metrics")
    finally:
        STREAM_SUBSCRIBERS.labels(kind="ws").dec()
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    body = response.text
    for name in (
        "dispach_turns_ended_total",
        "dispach_turns_running",
        "dispach_step_seconds",
        "dispach_model_call_seconds",
        "dispach_tool_call_seconds",
        "dispach_append_seconds",
        "dispach_append_batch_commands",
        "dispach_events_appended_total",
    ):
        assert f"# TYPE {name}" in body, name
    assert 'dispach_stream_subscribers{kind="ws"}' in body
