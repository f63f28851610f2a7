"""The turn engine against the fake Anthropic server (the real SDK, a real local HTTP server),
with real Postgres and NATS: tool round trips, every end reason, concurrency policies, stop,
repair, retries and mid-stream failures."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Literal

import msgspec
import pytest

from eventstore import START, RecordedEvent, subjects
from eventstore.catalogue import (
    ModelCall,
    ModelResult,
    ModelRetry,
    ToolRepair,
    ToolResult,
    TurnEnd,
)
from runtime.node import Node
from tests import fakes
from tests.conftest import ConnectFactory, NodeFactory
from tests.fakes import FakeAnthropic, HttpError, Reply, StreamFault, ToolUse, estimate_input_tokens
from tests.turns import refused, send, stop, store_of, turn_row, types, wait_end

fake_anthropic = fakes.fake_anthropic

KEY_ENV = "DISPACH_TEST_ANTHROPIC_KEY"


def manifest(fake: FakeAnthropic, **limits: object) -> str:
    limit_lines = "".join(f"\n  {k}: {v}" for k, v in limits.items())
    return f"""
id: helper
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {fake.url}
  api_key_env: {KEY_ENV}
  max_output_tokens: 1024
instructions:
  - You are a careful test agent.
tools: [current_time, calculator, session_notes]
limits:
  tool_timeout_s: 10{limit_lines}
"""


async def started(node_factory: NodeFactory, fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch,
                  concurrency: str = "queue", **limits: object) -> Node:  # fmt: skip
    monkeypatch.setenv(KEY_ENV, "test-key")
    text = manifest(fake, **limits) + f"session:\n  concurrency: {concurrency}\n"
    node_factory.write_agent("helper", text)
    return await node_factory.start()


def squeezed(events: list[RecordedEvent]) -> list[str]:
    """Event types with each run of ``model.chunk`` counted once (coalescing depends on timing)."""
    out: list[str] = []
    for name in types(events):
        if not (name == "model.chunk" and out and out[-1] == name):
            out.append(name)
    return out


def end_of(events: list[RecordedEvent]) -> TurnEnd:
    end = events[-1].data
    assert isinstance(end, TurnEnd)
    assert [e.type for e in events].count("turn.end") == 1
    return end


async def first_event(node: Node, turn_id: str, type_name: str) -> RecordedEvent:
    async for event in store_of(node).subscribe(START, where=lambda e: e.type == type_name):
        if event.metadata.turn_id == turn_id:
            return event
    raise AssertionError("unreachable")


@pytest.mark.asyncio
async def test_two_tools_in_one_step_then_an_answer(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(
        Reply(text="Let me check both.", tool_uses=[
            ToolUse("calculator", {"expression": "6*7"}, id="toolu_calc"),
            ToolUse("current_time", {"timezone": "UTC"}, id="toolu_time"),
        ]),
        Reply(text="It is 42, and I know the time."),
    )  # fmt: skip
    node = await started(node_factory, fake_anthropic, monkeypatch)
    accepted = await send(node, "helper", "what is 6*7 and what time is it?")
    events = await wait_end(node, accepted.turn_id)
    assert squeezed(events) == [
        "turn.start",
        "model.call", "model.chunk", "model.result",
        "tool.call", "tool.call", "tool.result", "tool.result",
        "model.call", "model.chunk", "model.result",
        "turn.end",
    ]  # fmt: skip
    end = end_of(events)
    assert end.reason == "final"
    assert end.steps == 2
    assert end.text == "Let me check both.\n\nIt is 42, and I know the time."
    second = fake_anthropic.message_requests()[1].body
    results = [b for b in second["messages"][-1]["content"] if b["type"] == "tool_result"]
    assert [(r["tool_use_id"], r["is_error"]) for r in results] == [
        ("toolu_calc", False), ("toolu_time", False)
    ]  # fmt: skip
    assert results[0]["content"] == "42"
    first = fake_anthropic.message_requests()[0].body
    assert first["system"][-1]["cache_control"] == {"type": "ephemeral"}
    assert [t["name"] for t in first["tools"]] == [
        "current_time",
        "calculator",
        "session_notes",
        "artifact_read",
    ]
    row = await turn_row(node, accepted.turn_id)
    assert (row["status"], row["steps"], row["text"]) == ("final", 2, end.text)
    assert row["output_tokens"] > 0


@pytest.mark.asyncio
async def test_max_steps_ends_with_the_partial_text(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.default = Reply(
        text="Again.", tool_uses=[ToolUse("calculator", {"expression": "1+1"})]
    )
    node = await started(node_factory, fake_anthropic, monkeypatch, max_steps=2)
    accepted = await send(node, "helper", "loop forever")
    end = end_of(await wait_end(node, accepted.turn_id))
    assert end.reason == "max_steps"
    assert end.steps == 2
    assert end.text == "Again.\n\nAgain."
    assert end.error is not None and end.error.code == "max_steps"


@pytest.mark.asyncio
async def test_timeout_ends_with_the_partial_text(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(Reply(text="slow words " * 40, chunk_size=4, event_delay=0.05))
    node = await started(node_factory, fake_anthropic, monkeypatch, turn_timeout_s=1)
    accepted = await send(node, "helper", "take your time")
    events = await wait_end(node, accepted.turn_id)
    end = end_of(events)
    assert end.reason == "timeout"
    assert end.error is not None and end.error.code == "turn_timeout"
    assert end.text.startswith("slow words")
    assert len(end.text) < len("slow words " * 40)


@pytest.mark.asyncio
async def test_a_reply_cut_off_by_max_tokens_ends_truncated_with_its_text(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(Reply(text="This reply was cut", stop_reason="max_tokens"))
    node = await started(node_factory, fake_anthropic, monkeypatch)
    accepted = await send(node, "helper", "write a novel")
    end = end_of(await wait_end(node, accepted.turn_id))
    assert end.reason == "truncated"
    assert end.error is not None and end.error.code == "reply_truncated"
    assert end.text == "This reply was cut"


@pytest.mark.asyncio
async def test_429_then_success_is_one_turn_with_the_retry_in_its_events(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(HttpError(429, "rate_limit_error", retry_after_ms=5), Reply(text="ok"))
    node = await started(node_factory, fake_anthropic, monkeypatch)
    accepted = await send(node, "helper", "hi")
    events = await wait_end(node, accepted.turn_id)
    retries = [e.data for e in events if isinstance(e.data, ModelRetry)]
    assert [(r.status, r.attempt) for r in retries] == [(429, 1)]
    assert end_of(events).reason == "final"
    assert len(fake_anthropic.message_requests()) == 2


@pytest.mark.asyncio
async def test_529_mid_stream_ends_the_turn_with_a_clear_error(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(StreamFault(Reply(text="halfway there"), after_events=5, kind="error"))
    node = await started(node_factory, fake_anthropic, monkeypatch)
    accepted = await send(node, "helper", "hi")
    end = end_of(await wait_end(node, accepted.turn_id))
    assert end.reason == "error"
    assert end.error is not None and end.error.code == "model_overloaded"
    assert end.error.hint
    row = await turn_row(node, accepted.turn_id)
    assert (row["status"], row["error_code"]) == ("error", "model_overloaded")


@pytest.mark.asyncio
async def test_malformed_tool_input_gets_one_repair_round(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("calculator", {"expr": "1+1"}, id="toolu_bad")]),
        Reply(tool_uses=[ToolUse("calculator", {"expression": "1+1"}, id="toolu_good")]),
        Reply(text="2"),
    )
    node = await started(node_factory, fake_anthropic, monkeypatch)
    accepted = await send(node, "helper", "1+1?")
    events = await wait_end(node, accepted.turn_id)
    repair = [e.data for e in events if isinstance(e.data, ToolRepair)]
    assert len(repair) == 1
    assert repair[0].slugs == ["calculator"]
    assert any("expression" in e for e in repair[0].errors)
    end = end_of(events)
    assert end.reason == "final"
    sent = fake_anthropic.message_requests()[1].body["messages"][-1]["content"][0]
    assert sent["is_error"] is True and "expression" in sent["content"]


@pytest.mark.asyncio
async def test_invalid_input_after_the_repair_round_fails_the_turn(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("calculator", raw_json='{"expression": ')]),
        Reply(tool_uses=[ToolUse("calculator", {"wrong": 1})]),
    )
    node = await started(node_factory, fake_anthropic, monkeypatch)
    accepted = await send(node, "helper", "1+1?")
    events = await wait_end(node, accepted.turn_id)
    end = end_of(events)
    assert end.reason == "error"
    assert end.error is not None and end.error.code == "tool_repair_failed"
    results = [e.data for e in events if isinstance(e.data, ToolResult)]
    assert "not valid JSON" in (results[0].output or "")


@pytest.mark.asyncio
async def test_stop_mid_stream_keeps_the_partial_text_and_the_session_goes_on(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(Reply(text="one two three four five six " * 20, chunk_size=6,
                                event_delay=0.05), Reply(text="Next turn fine."))  # fmt: skip
    node = await started(node_factory, fake_anthropic, monkeypatch)
    accepted = await send(node, "helper", "count slowly")
    await asyncio.wait_for(first_event(node, accepted.turn_id, "model.chunk"), 10)
    assert node.nc is not None
    asked = time.monotonic()
    assert (await stop(node, accepted.turn_id)).stopping
    events = await wait_end(node, accepted.turn_id)
    took = time.monotonic() - asked
    end = end_of(events)
    assert end.reason == "stopped"
    assert end.text
    assert ("one two three four five six " * 20).startswith(end.text)
    assert took < 1.0, f"stop took {took:.2f} s"  # measured 20-40 ms; slack for a loaded box
    follow = await send(node, "helper", "and now?")
    follow_end = end_of(await wait_end(node, follow.turn_id))
    assert follow_end.reason == "final"
    history = fake_anthropic.message_requests()[-1].body["messages"]
    assert history[1]["role"] == "assistant"
    assert history[1]["content"][0]["text"] == end.text


@pytest.mark.asyncio
async def test_queue_runs_one_after_the_other(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.default = Reply(text="done", event_delay=0.02)
    node = await started(node_factory, fake_anthropic, monkeypatch)
    first, second = await asyncio.gather(send(node, "helper", "a"), send(node, "helper", "b"))
    one = await wait_end(node, first.turn_id)
    two = await wait_end(node, second.turn_id)
    spans = sorted([(one[1].position, one[-1].position), (two[1].position, two[-1].position)])
    assert spans[0][1] < spans[1][0]  # attempts never overlap
    assert end_of(one).reason == end_of(two).reason == "final"


@pytest.mark.asyncio
async def test_reject_refuses_a_second_message_while_a_turn_runs(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(Reply(text="slow " * 30, chunk_size=5, event_delay=0.02))
    node = await started(node_factory, fake_anthropic, monkeypatch, concurrency="reject")
    first = await send(node, "helper", "a")
    busy = await refused(node, "helper", "b")
    assert busy.code == "session_busy"
    assert busy.hint
    assert end_of(await wait_end(node, first.turn_id)).reason == "final"
    later = await send(node, "helper", "c")
    assert end_of(await wait_end(node, later.turn_id)).reason == "final"


@pytest.mark.asyncio
async def test_interrupt_stops_the_running_turn_and_runs_the_new_one(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(Reply(text="long " * 100, chunk_size=5, event_delay=0.03),
                          Reply(text="second"))  # fmt: skip
    node = await started(node_factory, fake_anthropic, monkeypatch, concurrency="interrupt")
    first = await send(node, "helper", "a")
    await asyncio.wait_for(first_event(node, first.turn_id, "model.chunk"), 10)
    second = await send(node, "helper", "b")
    assert end_of(await wait_end(node, first.turn_id)).reason == "stopped"
    end = end_of(await wait_end(node, second.turn_id))
    assert (end.reason, end.text) == ("final", "second")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("kind", "code"),
    [
        ("drop", "model_connection_dropped"),
        ("truncate", "model_stream_truncated"),
        ("stall", "model_stalled"),
    ],
)
async def test_mid_stream_failures_are_classified(
    node_factory: NodeFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    kind: Literal["drop", "truncate", "stall"],
    code: str,
) -> None:
    fake_anthropic.script(StreamFault(Reply(text="abcdefghijkl" * 4), after_events=5, kind=kind))
    monkeypatch.setenv(KEY_ENV, "test-key")
    node_factory.write_agent("helper", manifest(fake_anthropic).replace(
        "max_output_tokens: 1024", "max_output_tokens: 1024\n  stall_timeout_s: 0.5"
    ))  # fmt: skip
    node = await node_factory.start()
    accepted = await send(node, "helper", "hi")
    end = end_of(await wait_end(node, accepted.turn_id))
    assert end.reason == "error"
    assert end.error is not None and end.error.code == code


@pytest.mark.asyncio
async def test_the_turn_resource_exists_as_soon_as_the_message_is_accepted(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(Reply(text="slow " * 20, chunk_size=5, event_delay=0.02))
    node = await started(node_factory, fake_anthropic, monkeypatch)
    accepted = await send(node, "helper", "hi")
    row = await turn_row(node, accepted.turn_id)  # no waiting: 202 means durable
    assert row["status"] == "running"
    assert row["input"] == "hi"
    await wait_end(node, accepted.turn_id)


@pytest.mark.asyncio
async def test_ingress_refuses_bad_messages_with_code_message_and_hint(
    node_factory: NodeFactory,
) -> None:
    node = await node_factory.start()
    assert node.nc is not None
    cases = {
        b"not json": "invalid_message",
        b'{"text": 5}': "invalid_message",
        b'{"text": "hi", "extra": 1}': "invalid_message",
        b'{"text": "   "}': "message_text_required",
    }
    for body, code in cases.items():
        answer = await node.nc.request(subjects.ingress("assistant"), body, timeout=5)
        error = msgspec.json.decode(answer.data)["error"]
        assert error["code"] == code, body
        assert error["message"] and error["hint"]
    answer = await node.nc.request(subjects.ingress("nobody"), b'{"text": "hi"}', timeout=5)
    assert msgspec.json.decode(answer.data)["error"]["code"] == "agent_not_found"
    ok = await node.nc.request(subjects.ingress("assistant"), b'{"text": "hi"}', timeout=5)
    reply = msgspec.json.decode(ok.data)
    assert set(reply) == {"turnId", "sessionKey"}
    assert reply["sessionKey"] == "api:default"


@pytest.mark.asyncio
async def test_stop_mid_tool_closes_the_call_as_cancelled(
    node_factory: NodeFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    marker = tmp_path / "runs.txt"
    marker.touch()
    monkeypatch.setenv(KEY_ENV, "test-key")
    tool = """
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran, then waits.
    mutating: true
    input_schema: {type: object, properties: {path: {type: string}, seconds: {type: number}}}
"""
    builtins = "tools: [current_time, calculator, session_notes]"
    node_factory.write_agent("helper", manifest(fake_anthropic).replace(builtins, "tools:" + tool))
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("record", {"path": str(marker), "seconds": 5}, id="toolu_w")]),
        Reply(text="after the stop"),
    )
    node = await node_factory.start()
    accepted = await send(node, "helper", "record it")
    await asyncio.wait_for(first_event(node, accepted.turn_id, "tool.call"), 10)
    assert node.nc is not None
    asked = time.monotonic()
    await stop(node, accepted.turn_id)
    events = await wait_end(node, accepted.turn_id)
    took = time.monotonic() - asked
    end = end_of(events)
    assert end.reason == "stopped"
    assert took < 1.0, f"stop took {took:.2f} s while the tool sleeps 5 s"
    [closed] = [e.data for e in events if isinstance(e.data, ToolResult)]
    assert closed.call_id == "toolu_w" and not closed.ok
    assert (closed.output or "").startswith("cancelled")
    follow = await send(node, "helper", "still there?")
    assert end_of(await wait_end(node, follow.turn_id)).reason == "final"
    history = fake_anthropic.message_requests()[-1].body["messages"]
    assert history[2]["content"][0]["tool_use_id"] == "toolu_w"  # the transcript stayed valid


@pytest.mark.asyncio
async def test_a_turn_survives_its_database_connections_being_cut(
    node_factory: NodeFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    connect: ConnectFactory,
) -> None:
    fake_anthropic.script(
        Reply(text="first part " * 10, chunk_size=10, event_delay=0.05),
        Reply(text="answered after the outage"),
    )
    node = await started(node_factory, fake_anthropic, monkeypatch)
    accepted = await send(node, "helper", "hi")
    await asyncio.wait_for(first_event(node, accepted.turn_id, "model.chunk"), 10)
    with connect(autocommit=True) as admin:
        cut = admin.execute(
            b"""SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                 WHERE application_name = 'dispach' AND pid <> pg_backend_pid()"""
        ).fetchone()
    assert cut is not None and cut[0] > 0
    events = await wait_end(node, accepted.turn_id, timeout=60)
    end = end_of(events)
    assert end.reason == "final"
    follow = await send(node, "helper", "still there?")
    assert end_of(await wait_end(node, follow.turn_id)).reason == "final"


@pytest.mark.asyncio
async def test_each_model_call_shows_its_cache_reads_and_writes_on_the_turn(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second turn of a session reads the first one's prefix from the provider's cache: each
    call's usage is on the turn resource, as the model reported it."""
    fake_anthropic.cache_min_tokens = 64
    fake_anthropic.script(
        Reply(text="Counting.", tool_uses=[ToolUse("calculator", {"expression": "6*7"})]),
        Reply(text="It is 42."),
        Reply(text="Still 42."),
    )
    node = await started(node_factory, fake_anthropic, monkeypatch)
    first = await send(node, "helper", "what is 6*7?", "cached")
    await wait_end(node, first.turn_id)
    second = await send(node, "helper", "and again?", "cached")
    events = await wait_end(node, second.turn_id)
    reported = [e.data for e in events if isinstance(e.data, ModelResult)]
    assert reported[0].cache_read_tokens > 0
    for turn_id, calls in ((first.turn_id, 2), (second.turn_id, 1)):
        row = await turn_row(node, turn_id)
        assert len(row["calls"]) == calls
        assert row["cache_read_tokens"] == sum(c["cacheReadTokens"] for c in row["calls"])
        assert row["cache_write_tokens"] == sum(c["cacheWriteTokens"] for c in row["calls"])
    row = await turn_row(node, second.turn_id)
    (call,) = row["calls"]
    assert call["cacheReadTokens"] == reported[0].cache_read_tokens
    assert call["promptTokens"] == reported[0].prompt_tokens and call["finishReason"] == "end_turn"


@pytest.mark.asyncio
async def test_a_provider_that_finds_the_prompt_too_long_ends_the_turn_with_a_clear_code(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's manifest claims a bigger window than the model has: the provider's 400 is
    named for what it is, not a generic API error."""
    fake_anthropic.context_window = 1500  # the manifest's default window is 200,000 tokens
    node = await started(node_factory, fake_anthropic, monkeypatch)
    accepted = await send(node, "helper", "x" * 8000)
    end = end_of(await wait_end(node, accepted.turn_id))
    assert end.reason == "error" and end.error is not None
    assert end.error.code == "context_window_exceeded"
    assert "prompt is too long" in end.error.message
    assert "reserve_output" in end.error.hint
    assert fake_anthropic.pending == 0 and len(fake_anthropic.message_requests()) == 1


@pytest.mark.asyncio
async def test_count_tokens_asks_the_provider_before_each_call(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``context.count_tokens: true`` the pressure is the provider's own count of the very
    request that is then sent."""
    monkeypatch.setenv(KEY_ENV, "test-key")
    node_factory.write_agent(
        "helper", manifest(fake_anthropic) + "context:\n  count_tokens: true\n"
    )
    fake_anthropic.script(
        Reply(text="Counting.", tool_uses=[ToolUse("calculator", {"expression": "6*7"})]),
        Reply(text="42."),
    )
    node = await node_factory.start()
    accepted = await send(node, "helper", "what is 6*7?")
    events = await wait_end(node, accepted.turn_id)
    assert end_of(events).reason == "final"
    counted = fake_anthropic.requests
    paths = [r.path for r in counted]
    assert paths == ["/v1/messages/count_tokens", "/v1/messages"] * 2
    pressures = [e.data.pressure for e in events if isinstance(e.data, ModelCall)]
    assert [p.source if p else None for p in pressures] == ["reported", "reported"]
    for pressure, count, sent in zip(pressures, counted[0::2], counted[1::2], strict=True):
        assert pressure is not None
        assert count.body["messages"] == sent.body["messages"]
        assert pressure.tokens == estimate_input_tokens(sent.body)


@pytest.mark.asyncio
async def test_the_first_turn_of_a_reactivated_session_reads_its_history_from_the_log(
    node_factory: NodeFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The session actor holds no history once passivated: its next turn's history is read
    from the log, and holds the turns before it, never the turn itself."""
    fake_anthropic.script(Reply(text="Noted: blue."), Reply(text="You said blue."))
    monkeypatch.setenv(KEY_ENV, "test-key")
    node_factory.write_agent("helper", manifest(fake_anthropic))
    node = await node_factory.start(session_idle_seconds=0.5)
    first = await send(node, "helper", "my colour is blue", session="colours")
    assert end_of(await wait_end(node, first.turn_id)).reason == "final"
    engine = node.engine
    assert engine is not None
    while ("helper", "colours") in engine.live_sessions():
        await asyncio.sleep(0.05)
    second = await send(node, "helper", "what is my colour?", session="colours")
    assert end_of(await wait_end(node, second.turn_id)).reason == "final"
    sent = fake_anthropic.message_requests()[1].body["messages"]
    said = [b.get("text") for m in sent for b in (m["content"] if isinstance(m["content"], list)
            else [{"text": m["content"]}])]  # fmt: skip
    assert said.count("my colour is blue") == 1 and said.count("Noted: blue.") == 1
    assert said.count("what is my colour?") == 1
    assert said.index("my colour is blue") < said.index("what is my colour?")
