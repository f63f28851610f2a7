"""What a turn reads of its session's past: the turns that ran before it, in order, the same
whether the session actor holds the history in memory or loads it from the messages projection."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests import fakes
from tests.conftest import NodeFactory
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.test_turns_anthropic import started
from tests.turns import send, wait_end

fake_anthropic = fakes.fake_anthropic


def said(body: dict[str, Any]) -> list[tuple[str, str]]:
    """The conversation a request carried, as (role, text) with tool blocks named."""
    out = []
    for message in body["messages"]:
        for block in message["content"]:
            text = block.get("text") or f"[{block['type']}]"
            out.append((message["role"], text))
    return out


def bare(value: Any) -> Any:
    """``value`` without its cache_control markers."""
    if isinstance(value, dict):
        return {k: bare(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [bare(v) for v in value]
    return value


def echo(body: dict[str, Any]) -> Reply:
    last = body["messages"][-1]["content"][-1]
    if last.get("type") == "text" and "calculate" in last["text"]:
        return Reply(text="Counting.", tool_uses=[ToolUse("calculator", {"expression": "6*7"})])
    return Reply(text=f"re: {last.get('text', '?')}", event_delay=0.01)


@pytest.mark.asyncio
async def test_queued_messages_see_only_the_turns_that_ran_before_them(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.responder = echo
    node = await started(node_factory, fake_anthropic, monkeypatch)
    accepted = await asyncio.gather(*(send(node, "helper", f"m{i}", "burst") for i in range(3)))
    for a in accepted:
        await wait_end(node, a.turn_id)
    bodies = [r.body for r in fake_anthropic.message_requests()]
    assert [said(b) for b in bodies] == [
        [("user", "m0")],
        [("user", "m0"), ("assistant", "re: m0"), ("user", "m1")],
        [("user", "m0"), ("assistant", "re: m0"), ("user", "m1"), ("assistant", "re: m1"),
         ("user", "m2")],
    ]  # fmt: skip


@pytest.mark.asyncio
async def test_history_from_memory_equals_history_from_the_log(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.responder = echo
    node = await started(node_factory, fake_anthropic, monkeypatch)
    for text in ("first", "calculate 6*7 please", "third"):
        await wait_end(node, (await send(node, "helper", text, "twice")).turn_id)
    # The session actor holds the history now; a second node reads it from the projection.
    warm = await send(node, "helper", "from memory", "twice")
    await wait_end(node, warm.turn_id)
    from_memory = fake_anthropic.message_requests()[-1].body["messages"]
    await node.stop()
    node_factory.started.remove(node)
    cold = await node_factory.start()
    again = await send(cold, "helper", "from the log", "twice")
    await wait_end(cold, again.turn_id)
    from_log = fake_anthropic.message_requests()[-1].body["messages"]
    # The warm request (history + its message) is, byte for byte, where the cold one begins
    # (cache breakpoints move to the newest block; the content they mark does not change).
    from_memory, from_log = bare(from_memory), bare(from_log)
    assert from_log[: len(from_memory)] == from_memory
    assert said({"messages": from_log[len(from_memory) :]}) == [
        ("assistant", "re: from memory"), ("user", "from the log"),
    ]  # fmt: skip
    assert any(b["type"] == "tool_result" for m in from_memory for b in m["content"])
