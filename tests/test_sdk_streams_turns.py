"""The anthropic SDK repository's own recorded streams, each replayed byte for byte as the model's
reply to a real turn (the real SDK, real Postgres and NATS), and the next turn's request checked
by the fake the way the API checks it. Runs when ``DISPACH_SDK_STREAMS`` names a checkout of
anthropics/anthropic-sdk-python (or its ``tests`` folder); the suite's own streams of the same
shapes run always (tests/test_model_blocks.py)."""

from __future__ import annotations

from typing import Any

import pytest

from eventstore import RecordedEvent
from eventstore.catalogue import ModelChunk, ModelResult, ToolCall, ToolResult, TurnEnd
from tests import fakes
from tests.conftest import NodeFactory
from tests.fakes import FakeAnthropic
from tests.fakes import anthropic_server as fa
from tests.fakes.sdk_streams import ENV, SdkStream, fold, sdk_recorded_streams
from tests.turns import send, wait_end

fake_anthropic = fakes.fake_anthropic
KEY_ENV = "DISPACH_TEST_ANTHROPIC_KEY"
STREAMS = sdk_recorded_streams()


def manifest(fake: FakeAnthropic, tools: set[str]) -> str:
    declared = "".join(
        f"\n  - name: {name}\n    module: tests.fixtures_tools:echo\n"
        f"    input_schema: {{type: object}}"
        for name in sorted(tools)
    )
    return f"""
id: replay
model:
  provider: anthropic
  base_url: {fake.url}
  api_key_env: {KEY_ENV}
tools:{declared or " []"}
"""


def vouch_for(fake: FakeAnthropic, content: list[dict[str, Any]]) -> None:
    """The real API signed what the recording holds; the fake takes those values back."""
    issuer = fake.issuer
    for block in content:
        kind = block.get("type")
        if kind == "thinking" and block.get("signature"):
            issuer.vouch("thinking", block["signature"], block.get("thinking", ""))
        elif kind == "redacted_thinking":
            issuer.vouch("redacted_thinking", block.get("data", ""))
        elif kind == "compaction" and block.get("content") is not None:
            if block.get("encrypted_content"):
                issuer.vouch("compaction", block["encrypted_content"], block["content"])
            if block.get("signature"):
                issuer.vouch("compaction-signature", block["signature"], block["content"])


def of(events: list[RecordedEvent], kind: type) -> list[Any]:
    return [e.data for e in events if isinstance(e.data, kind)]


@pytest.mark.asyncio
@pytest.mark.skipif(not STREAMS, reason=f"{ENV} names no checkout of the SDK's repository")
@pytest.mark.parametrize("stream", STREAMS, ids=[s.name for s in STREAMS])
async def test_a_recorded_stream_gives_the_right_turn_and_a_valid_next_request(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch,
    stream: SdkStream,
) -> None:  # fmt: skip
    message = fold(stream.events)
    content: list[dict[str, Any]] = message["content"]
    stop = message.get("stop_reason")
    tools = {b["name"] for b in content if b.get("type") == "tool_use"}
    monkeypatch.setenv(KEY_ENV, "test-key")
    node_factory.write_agent("replay", manifest(fake_anthropic, tools))
    node = await node_factory.start()
    vouch_for(fake_anthropic, content)
    fake_anthropic.script(fa.RawStream(stream.text))
    fake_anthropic.default = fa.Reply(text="ok")
    events = await wait_end(node, (await send(node, "replay", "go")).turn_id)
    end = events[-1].data
    assert isinstance(end, TurnEnd)
    if stop is None:  # the recording ends before its last event
        assert end.reason == "error"
        return
    first = of(events, ModelResult)[0]
    said = "".join(b.get("text", "") for b in content if b.get("type") == "text")
    answer = "".join(e.data.delta for e in events
                     if isinstance(e.data, ModelChunk) and e.data.kind == "text")  # fmt: skip
    # Text assembled; thinking never in it.
    assert first.text == said
    assert answer.startswith(said)
    for thought in (b.get("thinking") for b in content if b.get("type") == "thinking"):
        if thought:
            assert thought not in end.text and thought not in answer
    calls = [c for c in of(events, ToolCall) if not c.server]
    results = [r for r in of(events, ToolResult) if not r.server]
    if stop == "tool_use":  # each call run once
        used = [b["id"] for b in content if b.get("type") == "tool_use"]
        assert [c.call_id for c in calls] == used
        assert sorted(r.call_id for r in results) == sorted(used)
        assert all(r.ok for r in results)
    if stop == "max_tokens":  # a cut-off call never runs
        assert calls == []
        assert end.reason in ("truncated", "output_limit")
    if stop == "refusal":
        assert end.reason == "refused"
    server_uses = [b["id"] for b in (first.content or []) if b.get("type") == "server_tool_use"]
    assert [c.call_id for c in of(events, ToolCall) if c.server] == server_uses
    # The next turn's request is one the API accepts (the fake refuses it otherwise).
    fake_anthropic.default = fa.Reply(text="next")
    after = await wait_end(node, (await send(node, "replay", "and then?")).turn_id)
    last = after[-1].data
    assert isinstance(last, TurnEnd) and (last.reason, last.text) == ("final", "next")
    body = fake_anthropic.message_requests()[-1].body
    sent = [b for m in body["messages"] if m["role"] == "assistant" for b in m["content"]]
    assert all(b.get("text") for b in sent if b["type"] == "text")
    for block in content:
        if block.get("type") in ("compaction", "thinking", "redacted_thinking") and (
            block.get("signature") or block.get("data") or block.get("content")
        ):
            assert block in fa.without_cache_control(sent)
