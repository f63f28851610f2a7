"""One conversation, two providers: the same turn through the fake Anthropic server and the fake
OpenAI server (each the real SDK on a real socket) gives the same events, less what only a
provider knows (signatures, token counts, latencies); and a manifest in the original Dispach's
form loads and runs on an OpenAI-compatible endpoint."""

from __future__ import annotations

from typing import Any

import pytest

from eventstore import RecordedEvent
from eventstore.catalogue import ModelChunk, ModelResult, ToolCall, ToolResult, TurnEnd
from runtime.node import Node
from tests import fakes
from tests.conftest import NodeFactory
from tests.fakes import FakeAnthropic
from tests.fakes import anthropic_server as anthropic_fake
from tests.fakes import openai_server as openai_fake
from tests.fakes.openai_server import FakeOpenAI
from tests.turns import send, wait_end

fake_anthropic = fakes.fake_anthropic
fake_openai = openai_fake.fake_openai

ANTHROPIC_KEY, OPENAI_KEY = "DISPACH_TEST_ANTHROPIC_KEY", "DISPACH_TEST_OPENAI_KEY"
STEPS = [
    ("I should compute the product first.", "Let me compute.", {"expression": "6*7"}),
    ("Now add one to 42.", "One more step.", {"expression": "42+1"}),
    ("Both results are in.", "It is 43.", None),
]


def manifest(agent: str, provider: str, url: str, key_env: str, thinking: str) -> str:
    return f"""
id: {agent}
model:
  provider: {provider}
  id: twin-model
  base_url: {url}
  api_key_env: {key_env}
  max_output_tokens: 4096
  thinking: {thinking}
instructions:
  - You are a careful test agent.
tools: [calculator]
"""


async def both(node_factory: NodeFactory, anthropic: FakeAnthropic, openai: FakeOpenAI,
               monkeypatch: pytest.MonkeyPatch) -> Node:  # fmt: skip
    monkeypatch.setenv(ANTHROPIC_KEY, "test-key")
    monkeypatch.setenv(OPENAI_KEY, "test-key")
    claude = manifest("claude", "anthropic", anthropic.url, ANTHROPIC_KEY, "{budget_tokens: 2048}")
    gpt = manifest("gpt", "openai", openai.url + "/v1", OPENAI_KEY, "{effort: medium}")
    node_factory.write_agent("claude", claude)
    node_factory.write_agent("gpt", gpt)
    return await node_factory.start()


def portable(events: list[RecordedEvent]) -> list[tuple[Any, ...]]:
    """The turn's events without what only one provider knows: chunks joined per run of one
    kind, model results by their text and finish, tool calls by name and input, results by
    outcome; ids, tokens, latencies and the provider's own block fields left out."""
    out: list[tuple[Any, ...]] = []
    for event in events:
        data = event.data
        match data:
            case ModelChunk(delta=delta, kind=kind):
                if out and out[-1][:2] == ("model.chunk", kind):
                    out[-1] = ("model.chunk", kind, out[-1][2] + delta)
                else:
                    out.append(("model.chunk", kind, delta))
            case ModelResult():
                kinds = [b["type"] for b in data.content or []]
                out.append(("model.result", data.text, data.finish_reason, kinds))
            case ToolCall():
                out.append(("tool.call", data.slug, data.args, data.mutating))
            case ToolResult():
                out.append(("tool.result", data.slug, data.ok, data.output))
            case TurnEnd():
                out.append(("turn.end", data.reason, data.steps, data.text))
            case _:
                out.append((event.type,))
    return out


@pytest.mark.asyncio
async def test_two_tool_steps_with_thinking_give_the_same_events_on_both_providers(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, fake_openai: FakeOpenAI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    fake_anthropic.script(*[
        anthropic_fake.Reply(thinking=thought, text=text, tool_uses=[
            anthropic_fake.ToolUse("calculator", args, id=f"toolu_{n}")] if args else [])
        for n, (thought, text, args) in enumerate(STEPS)
    ])  # fmt: skip
    fake_openai.script(*[
        openai_fake.Reply(reasoning=thought, text=text, tool_calls=[
            openai_fake.ToolCall("calculator", args, id=f"call_{n}")] if args else [])
        for n, (thought, text, args) in enumerate(STEPS)
    ])  # fmt: skip
    node = await both(node_factory, fake_anthropic, fake_openai, monkeypatch)
    claude = await wait_end(node, (await send(node, "claude", "what is 6*7+1?")).turn_id)
    gpt = await wait_end(node, (await send(node, "gpt", "what is 6*7+1?")).turn_id)
    assert portable(claude) == portable(gpt)
    end = claude[-1].data
    assert isinstance(end, TurnEnd)
    assert (end.reason, end.steps) == ("final", 3)
    assert end.text == "Let me compute.\n\nOne more step.\n\nIt is 43."
    assert [r.data.output for r in claude if isinstance(r.data, ToolResult)] == ["42", "43"]
    # Each request is one its API accepts (each fake validates like the real one), and each
    # provider got its own form of the same conversation.
    last_claude = fake_anthropic.message_requests()[-1].body
    assert [b["type"] for b in last_claude["messages"][-2]["content"]] == [
        "thinking", "text", "tool_use"
    ]  # fmt: skip
    last_gpt = fake_openai.completion_requests()[-1].body
    assert last_gpt["reasoning_effort"] == "medium"
    assert [m["role"] for m in last_gpt["messages"]] == [
        "system", "user", "assistant", "tool", "assistant", "tool"
    ]  # fmt: skip
    assert [c["function"]["name"] for c in last_gpt["messages"][2]["tool_calls"]] == ["calculator"]


V1_MANIFEST = """
apiVersion: dispach/v1
id: legacy
name: Legacy agent
model:
  main:
    id: local-model
    baseUrl: {url}
    maxTokens: 1024
context:
  window: 32768
tools:
  local: [now]
"""


@pytest.mark.asyncio
async def test_a_manifest_of_the_original_dispach_runs_on_an_openai_compatible_endpoint(
    node_factory: NodeFactory, fake_openai: FakeOpenAI
) -> None:
    fake_openai.script(openai_fake.Reply(text="Hello from a local model."))
    node_factory.write_agent("legacy", V1_MANIFEST.format(url=fake_openai.url + "/v1"))
    node = await node_factory.start()
    events = await wait_end(node, (await send(node, "legacy", "hello")).turn_id)
    end = events[-1].data
    assert isinstance(end, TurnEnd)
    assert (end.reason, end.text) == ("final", "Hello from a local model.")
    (request,) = fake_openai.completion_requests()
    assert request.body["model"] == "local-model"
    assert request.body["max_completion_tokens"] == 1024
    assert [t["function"]["name"] for t in request.body["tools"]] == [
        "current_time", "artifact_read"
    ]  # fmt: skip
    # No key variable in the manifest: no key of ours is sent to the endpoint.
    assert request.headers.get("authorization") == "Bearer unused"
