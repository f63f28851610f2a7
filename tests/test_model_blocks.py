"""The whole Messages API stream through a turn (the real SDK against the fake Anthropic server,
real Postgres and NATS): reasoning kept apart from the answer, thinking sent back signed, a
reply cut off by max_tokens never running its tool call, refusals, server tools, compaction and
block types not known yet, each followed by a next request the API would accept."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from eventstore import RecordedEvent
from eventstore.catalogue import ModelCall, ModelChunk, ModelResult, ToolCall, ToolResult, TurnEnd
from runtime.node import Node
from tests import fakes
from tests.conftest import NodeFactory
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.fakes import anthropic_server as fa
from tests.turns import send, stop, turn_row, wait_end

fake_anthropic = fakes.fake_anthropic

KEY_ENV = "DISPACH_TEST_ANTHROPIC_KEY"


def manifest(fake: FakeAnthropic, model_extra: str = "") -> str:
    return f"""
id: thinker
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {fake.url}
  api_key_env: {KEY_ENV}
  max_output_tokens: 4096{model_extra}
instructions:
  - You are a careful test agent.
tools: [current_time, calculator, session_notes]
"""


async def started(node_factory: NodeFactory, fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch,
                  model_extra: str = "") -> Node:  # fmt: skip
    monkeypatch.setenv(KEY_ENV, "test-key")
    node_factory.write_agent("thinker", manifest(fake, model_extra))
    return await node_factory.start()


THINKING = "\n  thinking:\n    budget_tokens: 2048"


def end_of(events: list[RecordedEvent]) -> TurnEnd:
    end = events[-1].data
    assert isinstance(end, TurnEnd)
    return end


def chunks(events: list[RecordedEvent], kind: str) -> str:
    return "".join(e.data.delta for e in events
                   if isinstance(e.data, ModelChunk) and e.data.kind == kind)  # fmt: skip


def of(events: list[RecordedEvent], kind: type) -> list[Any]:
    return [e.data for e in events if isinstance(e.data, kind)]


def blocks(body: dict[str, Any], role: str) -> list[dict[str, Any]]:
    return [b for m in body["messages"] if m["role"] == role for b in m["content"]]


@pytest.mark.asyncio
async def test_thinking_streams_as_reasoning_and_goes_back_signed_before_the_tool_use(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(
        Reply(thinking="I ponder the sum.", text="Let me compute.",
              tool_uses=[ToolUse("calculator", {"expression": "6*7"}, id="toolu_c")]),
        Reply(thinking="It said 42.", text="It is 42."),
    )  # fmt: skip
    node = await started(node_factory, fake_anthropic, monkeypatch, THINKING)
    events = await wait_end(node, (await send(node, "thinker", "6*7?")).turn_id)
    end = end_of(events)
    assert end.reason == "final"
    assert end.text == "Let me compute.\n\nIt is 42."
    assert chunks(events, "reasoning") == "I ponder the sum.It said 42."
    assert "ponder" not in chunks(events, "text")
    assert [r.text for r in of(events, ModelResult)] == ["Let me compute.", "It is 42."]
    row = await turn_row(node, events[0].metadata.turn_id or "")
    assert row["reasoning"] == "I ponder the sum.\n\nIt said 42."
    assert row["prompt_tokens"] == sum(r.prompt_tokens for r in of(events, ModelResult))
    first, second = (r.body for r in fake_anthropic.message_requests())
    assert first["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assistant = second["messages"][-2]
    assert assistant["role"] == "assistant"
    assert [b["type"] for b in assistant["content"]] == ["thinking", "text", "tool_use"]
    sent = assistant["content"][0]
    assert sent["thinking"] == "I ponder the sum." and sent["signature"]
    # The next turn reads both replies from the history, thinking blocks whole.
    fake_anthropic.script(Reply(text="Still 42."))
    await wait_end(node, (await send(node, "thinker", "and again?")).turn_id)
    third = fake_anthropic.message_requests()[-1].body
    thought = [b["thinking"] for b in blocks(third, "assistant") if b["type"] == "thinking"]
    assert thought == ["I ponder the sum.", "It said 42."]


@pytest.mark.asyncio
async def test_a_tool_call_cut_off_by_max_tokens_is_never_run_and_leaves_no_trace_in_history(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(Reply(
        text="I will note it.", stop_reason="max_tokens",
        tool_uses=[ToolUse("session_notes", raw_json='{"action": "append", "te')],
    ))  # fmt: skip
    node = await started(node_factory, fake_anthropic, monkeypatch)
    events = await wait_end(node, (await send(node, "thinker", "note: milk")).turn_id)
    end = end_of(events)
    assert (end.reason, end.error and end.error.code) == ("truncated", "reply_truncated")
    assert end.text == "I will note it."
    assert of(events, ToolCall) == [] and of(events, ToolResult) == []
    (result,) = of(events, ModelResult)
    assert [b["type"] for b in result.content or []] == ["text"]
    row = await turn_row(node, events[0].metadata.turn_id or "")
    assert (row["status"], row["error_code"]) == ("truncated", "reply_truncated")
    fake_anthropic.script(Reply(text="Noted now."))
    await wait_end(node, (await send(node, "thinker", "go on")).turn_id)
    body = fake_anthropic.message_requests()[-1].body
    assert all(b["type"] != "tool_use" for b in blocks(body, "assistant"))
    assert "truncated" in body["system"][-1]["text"]  # the model is told how the turn ended


@pytest.mark.asyncio
async def test_truncation_retry_sends_the_step_again_with_twice_the_budget(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(
        Reply(text="A long ans", stop_reason="max_tokens",
              tool_uses=[ToolUse("calculator", raw_json='{"expr')]),
        Reply(text="A long answer, whole."),
    )  # fmt: skip
    node = await started(node_factory, fake_anthropic, monkeypatch, "\n  truncation: retry")
    events = await wait_end(node, (await send(node, "thinker", "write")).turn_id)
    end = end_of(events)
    assert end.reason == "final"
    assert end.text == "A long answer, whole."
    cut, whole = of(events, ModelResult)
    assert cut.discarded and cut.content is None and cut.finish_reason == "max_tokens"
    assert not whole.discarded
    assert len(of(events, ModelCall)) == 2
    first, second = (r.body for r in fake_anthropic.message_requests())
    assert second["max_tokens"] == 2 * first["max_tokens"]
    assert second["messages"] == first["messages"]  # the cut reply is not part of it
    assert of(events, ToolCall) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("said", ["I can't help with", ""])
async def test_a_refusal_ends_refused_with_its_text_and_no_empty_block_goes_back(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch,
    said: str,
) -> None:  # fmt: skip
    fake_anthropic.script(Reply(text=said, stop_reason="refusal"), Reply(text="Hello."))
    node = await started(node_factory, fake_anthropic, monkeypatch)
    events = await wait_end(node, (await send(node, "thinker", "something bad")).turn_id)
    end = end_of(events)
    assert (end.reason, end.error and end.error.code) == ("refused", "model_refused")
    assert end.text == said
    await wait_end(node, (await send(node, "thinker", "hello")).turn_id)
    body = fake_anthropic.message_requests()[-1].body
    texts = [b.get("text") for m in body["messages"] for b in m["content"] if b["type"] == "text"]
    assert all(texts)
    roles = [m["role"] for m in body["messages"]]
    assert roles == (["user", "assistant", "user"] if said else ["user"])


@pytest.mark.asyncio
async def test_a_stop_mid_thinking_keeps_no_reasoning_and_the_next_request_is_valid(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(
        Reply(thinking="a very long chain of thought " * 40, text="never reached",
              chunk_size=8, event_delay=0.01),
        Reply(thinking="fresh", text="Fresh answer."),
    )  # fmt: skip
    node = await started(node_factory, fake_anthropic, monkeypatch, THINKING)
    accepted = await send(node, "thinker", "think hard")
    for _ in range(200):
        if fake_anthropic.message_requests():
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    await stop(node, accepted.turn_id)
    events = await wait_end(node, accepted.turn_id)
    end = end_of(events)
    assert end.reason == "stopped"
    assert end.text == ""
    assert "chain of thought" in chunks(events, "reasoning")
    assert chunks(events, "text") == ""
    await wait_end(node, (await send(node, "thinker", "try again")).turn_id)
    body = fake_anthropic.message_requests()[-1].body
    assert all(b["type"] != "thinking" for b in blocks(body, "assistant"))
    assert [m["role"] for m in body["messages"]] == ["user"]


SEARCH = "\n  server_tools:\n    - {name: web_search, max_uses: 3}"


@pytest.mark.asyncio
async def test_a_server_tool_is_recorded_counted_and_sent_back_whole_with_its_citations(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = fa.SearchResult(url="https://example.com/tides", title="Tide tables")
    fake_anthropic.script(fa.Reply(content=[
        fa.Text("Let me look that up."),
        fa.ServerToolUse("web_search", {"query": "high tide today"}, result=[page]),
        fa.Text("High tide is at 14:02.", citations=[fa.cite_search(page, "high tide 14:02")]),
    ]))  # fmt: skip
    node = await started(node_factory, fake_anthropic, monkeypatch, SEARCH)
    events = await wait_end(node, (await send(node, "thinker", "when is high tide?")).turn_id)
    end = end_of(events)
    assert (end.reason, end.text) == ("final", "Let me look that up.High tide is at 14:02.")
    (call,) = of(events, ToolCall)
    (result,) = of(events, ToolResult)
    assert (call.slug, call.server, call.args) == ("web_search", True, {"query": "high tide today"})
    assert (result.call_id, result.server, result.ok) == (call.call_id, True, True)
    assert result.output == "Tide tables <https://example.com/tides>"
    assert result.trust == "untrusted"  # a web page: mutating calls after it need approval
    (model_result,) = of(events, ModelResult)
    assert model_result.server_tool_requests == {"web_search_requests": 1}
    row = await turn_row(node, events[0].metadata.turn_id or "")
    assert row["calls"][0]["serverToolRequests"] == {"web_search_requests": 1}
    first = fake_anthropic.message_requests()[0].body
    assert {"type": "web_search_20250305", "name": "web_search", "max_uses": 3} in first["tools"]
    fake_anthropic.script(fa.Reply(text="You're welcome."))
    await wait_end(node, (await send(node, "thinker", "thanks")).turn_id)
    body = fake_anthropic.message_requests()[-1].body
    sent = fa.without_cache_control(blocks(body, "assistant"))  # our breakpoint aside
    assert [b["type"] for b in sent] == [
        "text", "server_tool_use", "web_search_tool_result", "text"
    ]  # fmt: skip
    assert sent == model_result.content  # byte for byte as the model sent them
    assert sent[3]["citations"][0]["url"] == "https://example.com/tides"
    assert all(b["type"] != "tool_result" for b in blocks(body, "user"))


@pytest.mark.asyncio
async def test_pause_turn_sends_the_paused_reply_back_and_the_turn_goes_on(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = fa.SearchResult(url="https://example.com/a", title="A")
    fake_anthropic.script(
        fa.Reply(content=[fa.ServerToolUse("web_search", {"query": "a"}, result=[page])],
                 stop_reason="pause_turn"),
        fa.Reply(text="Done searching."),
    )  # fmt: skip
    node = await started(node_factory, fake_anthropic, monkeypatch, SEARCH)
    events = await wait_end(node, (await send(node, "thinker", "search a")).turn_id)
    end = end_of(events)
    assert (end.reason, end.steps, end.text) == ("final", 2, "Done searching.")
    second = fake_anthropic.message_requests()[1].body
    assert second["messages"][-1]["role"] == "assistant"
    assert [b["type"] for b in second["messages"][-1]["content"]] == [
        "server_tool_use", "web_search_tool_result"
    ]  # fmt: skip


@pytest.mark.asyncio
async def test_compaction_redacted_thinking_and_unknown_blocks_go_back_as_they_came(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(fa.Reply(content=[
        fa.Redacted(),
        fa.Thinking("Short thought."),
        fa.Compaction("The person asked about tides; we found 14:02."),
        fa.Unknown("hologram", {"frames": [1, 2, 3], "note": "from the future"}),
        fa.Text("Here we are."),
    ]))  # fmt: skip
    node = await started(node_factory, fake_anthropic, monkeypatch, THINKING)
    events = await wait_end(node, (await send(node, "thinker", "recap")).turn_id)
    end = end_of(events)
    assert (end.reason, end.text) == ("final", "Here we are.")
    assert chunks(events, "reasoning") == "Short thought."
    (result,) = of(events, ModelResult)
    assert [b["type"] for b in result.content or []] == [
        "redacted_thinking", "thinking", "compaction", "hologram", "text"
    ]  # fmt: skip
    compaction = (result.content or [])[2]
    assert compaction["content"] == "The person asked about tides; we found 14:02."
    assert compaction["encrypted_content"]
    fake_anthropic.script(fa.Reply(text="Still here."))
    await wait_end(node, (await send(node, "thinker", "and now?")).turn_id)
    body = fake_anthropic.message_requests()[-1].body
    sent = fa.without_cache_control(blocks(body, "assistant"))
    assert sent == result.content  # and the fake checked each one as the API would


@pytest.mark.asyncio
async def test_a_tool_call_cut_off_without_its_block_stop_is_never_run(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(fa.Reply(
        content=[fa.Text("Saving it."),
                 fa.ToolUse("session_notes", {"action": "append", "text": "a long note"})],
        cut=fa.Cut(block=1, chars=14, stop=False),
    ))  # fmt: skip
    node = await started(node_factory, fake_anthropic, monkeypatch)
    events = await wait_end(node, (await send(node, "thinker", "note: a long note")).turn_id)
    end = end_of(events)
    assert (end.reason, end.text) == ("truncated", "Saving it.")
    assert of(events, ToolCall) == []
