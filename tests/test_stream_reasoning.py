"""The model's thinking, apart from its answer: ``model.chunk`` deltas of kind ``reasoning``
reach a stream only when it asks (``?reasoning=true``, ``reasoning: true`` on a WebSocket
subscription), the preambles say what a subscription gets (and whether chunks are only implied
by ``types``), and the turn resource carries ``reasoning`` beside ``text``, folded by the turns
projection from each ``model.result``'s thinking blocks.

The thinking turn is appended to the node's log directly (the offline model does not think): a
real turn first, so that the node owns the session's partition, then a whole turn of events."""

from __future__ import annotations

import contextlib
import uuid
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
import pytest_asyncio

from eventstore import Metadata, NewEvent, RecordedEvent
from eventstore.catalogue import (
    ModelChunk,
    ModelResult,
    Tokens,
    TurnAttempt,
    TurnEnd,
    TurnStart,
)
from eventstore.event import Event
from eventstore.feed import Scope
from eventstore.projections.turns import reasoning_of
from tests.conftest import ApiServer
from tests.test_api_http import client_of, ended, post
from tests.test_api_streams import (
    Frame,
    kind,
    opened,
    read_sse,
    receive,
    receive_until,
    send,
    sse_frames,
)
from tests.turns import store_of

Json = dict[str, Any]
SESSION = "think"
THOUGHT = "Let me think.\n\nSecond thought."
"""The turn's reasoning: each call's thinking, a blank line apart (the discarded call's and the
redacted block's contribute nothing)."""


def thinking(text: str, signature: str = "sig") -> dict[str, object]:
    return {"type": "thinking", "thinking": text, "signature": signature}


def call(
    prompt: int, content: list[dict[str, object]], finish: str = "end_turn", discarded: bool = False
) -> ModelResult:
    return ModelResult(prompt_tokens=prompt, output_tokens=10, finish_reason=finish,
                       latency_ms=5, content=content, discarded=discarded)  # fmt: skip


def thinking_turn() -> list[Event]:
    """A turn of two kept model calls (and one discarded) that think before they answer."""
    return [
        TurnStart(source="api", input="why?"),
        TurnAttempt(attempt=1, node="node-1"),
        ModelChunk(delta="Let me ", kind="reasoning"),
        ModelChunk(delta="think.", kind="reasoning"),
        ModelChunk(delta="Checking"),
        call(100, [thinking("Let me think."), {"type": "text", "text": "Checking"}]),
        call(120, [thinking("cut off")], "max_tokens", discarded=True),
        ModelChunk(delta="Second thought.", kind="reasoning"),
        ModelChunk(delta="Done"),
        call(140, [{"type": "redacted_thinking", "data": "opaque"}, thinking("Second thought."),
                   thinking(""), {"type": "text", "text": "Done"}]),
        TurnEnd(reason="final", steps=3, tokens=Tokens(prompt=360, output=30), duration_ms=40,
                text="Checking\n\nDone"),
    ]  # fmt: skip


class Thinking:
    """The node with its thinking turn: the turn's id, and a cursor just before it."""

    def __init__(self, api: ApiServer, turn_id: str, before: str) -> None:
        self.api, self.turn_id, self.before = api, turn_id, before

    @property
    def stream(self) -> str:
        return f"/v1/agents/assistant/turns/{self.turn_id}/stream"


@pytest_asyncio.fixture
async def thought(api: ApiServer) -> Thinking:
    async with client_of(api) as http:
        first = (await post(http, "hello", sessionKey=SESSION)).json()["turnId"]
        await ended(http, first)
        events = (await http.get(f"/v1/agents/assistant/turns/{first}/events")).json()["events"]
    turn_id = "t_" + uuid.uuid4().hex[:17]
    meta = Metadata(agent_id="assistant", session_key=SESSION, turn_id=turn_id)
    await store_of(api.node).aappend(
        f"turn-{turn_id}", [NewEvent(event=e, metadata=meta) for e in thinking_turn()]
    )
    return Thinking(api, turn_id, events[-1]["cursor"])


def chunk_kinds(frames: list[Frame]) -> list[str]:
    return [f.data["data"]["kind"] for f in frames if f.event == "model.chunk"]


TEXT = ["text", "text"]
REASONING = ["reasoning", "reasoning", "reasoning"]
BOTH = ["reasoning", "reasoning", "text", "reasoning", "text"]


# --- who gets which chunks -----------------------------------------------------------------------


def recorded(data: Event, type_name: str) -> RecordedEvent:
    return RecordedEvent(stream="turn-t", version=0, position=1, txid=1, event_id=uuid.uuid4(),
                         type=type_name, data=data, metadata=Metadata(turn_id="t"),
                         recorded_at=datetime.now(UTC))  # fmt: skip


@pytest.mark.parametrize(
    ("chunks", "reasoning", "text_chunk", "reasoning_chunk"),
    [
        (False, False, False, False),
        (True, False, True, False),
        (False, True, False, True),
        (True, True, True, True),
    ],
)
def test_a_scope_takes_reasoning_chunks_only_when_asked(
    chunks: bool, reasoning: bool, text_chunk: bool, reasoning_chunk: bool
) -> None:
    scope = Scope(chunks=chunks, reasoning=reasoning)
    answer = recorded(ModelChunk(delta="a"), "model.chunk")
    thought = recorded(ModelChunk(delta="b", kind="reasoning"), "model.chunk")
    other = recorded(TurnStart(source="api"), "turn.start")
    assert (scope.matches(answer), scope.matches(thought), scope.matches(other)) == (
        text_chunk,
        reasoning_chunk,
        True,
    )


def test_types_still_decide_for_reasoning_chunks() -> None:
    thought = recorded(ModelChunk(delta="b", kind="reasoning"), "model.chunk")
    assert not Scope(reasoning=True, types=frozenset({"turn.end"})).matches(thought)
    assert Scope(reasoning=True, types=frozenset({"model.chunk"})).matches(thought)


def test_a_calls_reasoning_is_its_thinking_blocks() -> None:
    assert reasoning_of(call(1, [thinking("a"), {"type": "text", "text": "x"}, thinking("b")])) \
        == "a\n\nb"  # fmt: skip
    assert reasoning_of(call(1, [{"type": "redacted_thinking", "data": "z"}])) == ""
    assert reasoning_of(call(1, [thinking("gone")], discarded=True)) == ""
    assert reasoning_of(call(1, [])) == ""
    assert reasoning_of(ModelResult(output_tokens=1, prompt_tokens=1, finish_reason="end_turn",
                                    latency_ms=1)) == ""  # fmt: skip


# --- the turn stream -----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("params", "kinds", "replay"),
    [
        ({}, [], {"chunks": "none", "reasoning": False, "implied": False}),
        ({"chunks": "true"}, TEXT, {"chunks": "start", "reasoning": False, "implied": False}),
        ({"reasoning": "true"}, REASONING, {"chunks": "none", "reasoning": True,
                                            "implied": False}),
        ({"chunks": "true", "reasoning": "true"}, BOTH, {"chunks": "start", "reasoning": True,
                                                         "implied": False}),
        ({"types": "model.chunk"}, TEXT, {"chunks": "start", "reasoning": False,
                                          "implied": True}),
        ({"types": "model.chunk", "reasoning": "true"}, BOTH, {"chunks": "start",
                                                               "reasoning": True,
                                                               "implied": True}),
        ({"types": "model.chunk", "chunks": "true"}, TEXT, {"chunks": "start",
                                                            "reasoning": False,
                                                            "implied": False}),
    ],
    ids=["none", "chunks", "reasoning", "both", "implied", "implied+reasoning", "asked+types"],
)  # fmt: skip
async def test_the_turn_stream_sends_the_chunks_asked_for_and_says_so(
    thought: Thinking, params: dict[str, str], kinds: list[str], replay: Json
) -> None:
    async with client_of(thought.api) as http:
        frames = await read_sse(http, thought.stream, params=params)
    head = frames[0]
    assert head.event == "stream.replay"
    assert {k: head.data[k] for k in replay} == replay
    assert chunk_kinds(frames) == kinds
    assert frames[-1].event == "stream.ended" and frames[-1].data["status"] == "final"
    if "types" in params:
        assert {f.event for f in frames[1:-1]} <= {"model.chunk"}


@pytest.mark.asyncio
async def test_a_message_streamed_with_reasoning_says_so(api: ApiServer) -> None:
    async with (
        client_of(api) as http,
        http.stream("POST", "/v1/agents/assistant/messages",
                    json={"text": "hello", "stream": True, "reasoning": True}) as response,
        contextlib.aclosing(sse_frames(response)) as frames,
    ):  # fmt: skip
        assert response.status_code == 202
        got = [frame async for frame in frames]
    assert [f.event for f in got[:2]] == ["turn.accepted", "stream.replay"]
    assert got[1].data["reasoning"] is True and got[1].data["chunks"] == "none"
    assert got[-1].event == "stream.ended"


# --- the firehose and the WebSocket --------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_firehose_sends_reasoning_when_asked_and_says_what_it_sends(
    thought: Thinking,
) -> None:
    def at_end(frame: Frame) -> bool:
        return frame.event == "turn.end" and frame.data["turnId"] == thought.turn_id

    async with client_of(thought.api) as http:
        plain = await read_sse(http, "/v1/events", params={"after": thought.before}, stop=at_end)
        asked = await read_sse(
            http,
            "/v1/events",
            params={"after": thought.before, "reasoning": "true", "types": "model.chunk,turn.end"},
            stop=at_end,
        )
    assert plain[0].event == asked[0].event == "stream.subscribed"
    assert {k: plain[0].data[k] for k in ("chunks", "reasoning", "implied")} == {
        "chunks": False, "reasoning": False, "implied": False}  # fmt: skip
    assert asked[0].data == {"agentId": None, "sessionKey": None, "after": thought.before,
                             "types": ["model.chunk", "turn.end"], "chunks": True,
                             "reasoning": True, "implied": True}  # fmt: skip
    assert chunk_kinds(plain) == []
    assert chunk_kinds(asked) == BOTH


@pytest.mark.asyncio
async def test_a_websocket_subscription_takes_reasoning_and_types(thought: Thinking) -> None:
    async with opened(thought.api) as ws:
        await send(ws, type="subscribe", turnId=thought.turn_id, reasoning=True, sub="r")
        thinking_only = await receive_until(ws, kind("stream.ended", "r"))
        await send(ws, type="subscribe", turnId=thought.turn_id, types=["model.chunk"], sub="t")
        typed = await receive_until(ws, kind("stream.ended", "t"))
        await send(ws, type="subscribe", turnId=thought.turn_id, types=["model.chunk", "nope"])
        refused = await receive(ws)
    assert thinking_only[0] == {"type": "ws.subscribed", "sub": "r", "turnId": thought.turn_id,
                                "agentId": "assistant", "sessionKey": None, "types": None,
                                "chunks": False, "reasoning": True,
                                "implied": False}  # fmt: skip
    kinds = [f["data"]["kind"] for f in thinking_only if f.get("type") == "model.chunk"]
    assert kinds == REASONING
    assert "turn.end" in [f.get("type") for f in thinking_only]
    assert typed[0]["types"] == ["model.chunk"] and typed[0]["implied"] is True
    events = [f for f in typed if "cursor" in f]
    assert [f["data"]["kind"] for f in events] == TEXT  # turn.end followed, not shown
    assert typed[-1]["type"] == "stream.ended" and typed[-1]["status"] == "final"
    assert refused["type"] == "ws.error" and refused["code"] == "unknown_event_type"
    assert refused["field"] == "types" and "nope" in refused["message"]


# --- the turn resource ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_turn_resource_carries_the_reasoning_beside_the_text(thought: Thinking) -> None:
    async with client_of(thought.api) as http:
        turn = (await http.get(f"/v1/agents/assistant/turns/{thought.turn_id}")).json()
        listed = (await http.get("/v1/agents/assistant/turns",
                                 params={"sessionKey": SESSION})).json()["turns"]  # fmt: skip
    assert turn["reasoning"] == THOUGHT and turn["text"] == "Checking\n\nDone"
    assert [t["reasoning"] for t in listed] == [THOUGHT, ""]  # newest first; no thinking: ""


@pytest.mark.asyncio
async def test_the_document_has_reasoning(api: ApiServer) -> None:
    async with httpx.AsyncClient(base_url=api.url) as http:
        doc = (await http.get("/v1/openapi.json")).json()
    turn = doc["components"]["schemas"]["TurnResource"]
    assert "reasoning" in turn["required"] and turn["properties"]["reasoning"]["type"] == "string"
    for path in ("/v1/events", "/v1/agents/{agent}/turns/{turn_id}/stream"):
        names = [p["name"] for p in doc["paths"][path]["get"]["parameters"]]
        assert "reasoning" in names, path
    assert "reasoning" in doc["components"]["schemas"]["MessageBody"]["properties"]
    assert "runtimeId" in doc["components"]["schemas"]["WireEvent"]["properties"]
