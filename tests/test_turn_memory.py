"""The turn resource of a turn this node ran, served from memory (eventstore/projections/
``turn_row``, gateways/api/turns.py ``load_turn``): the same resource the turns projection holds in
Postgres, for every kind of turn, running or ended; and only where memory can know it (the
stream from its start, nothing promised to a channel, and, while it runs, this node owning its
session since its start: another node may have taken it over)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec
import pytest

from actors.prices import PriceTable
from eventstore import INLINE, EventStore, Fenced, Metadata, NewEvent
from eventstore.catalogue import (
    ApprovalRequested,
    ApprovalResolved,
    ContextAssembled,
    DeliveryEnqueued,
    ErrorDetail,
    ModelChunk,
    ModelResult,
    SessionNote,
    Tokens,
    ToolCall,
    ToolResult,
    TurnAttempt,
    TurnEnd,
    TurnStart,
)
from eventstore.event import Event
from eventstore.feed import _ENDED_BYTES, _RECENT_EVENTS
from eventstore.fencing import Fence
from eventstore.projections.turns import turn_row
from gateways.api.common import sql
from gateways.api.schemas import TurnResource
from gateways.api.turns import turn_in_memory, turn_resource
from gateways.api.usage import priced
from tests.conftest import ApiServer
from tests.test_api_http import client_of, ended, post
from tests.test_stream_reasoning import call, thinking_turn
from tests.turns import store_of

SESSION = "memory"


def tool_turn() -> list[Event]:
    """Two calls with cache figures and a server tool, an approval asked and granted."""
    first = ModelResult(prompt_tokens=50, output_tokens=7, finish_reason="tool_use",
                        latency_ms=3, cache_read_tokens=40, cache_write_tokens=9,
                        server_tool_requests={"webSearchRequests": 1})  # fmt: skip
    return [
        TurnStart(source="api", input="add it up"),
        TurnAttempt(attempt=1, node="node-1"),
        ContextAssembled(slots=[], total=10),
        first,
        ToolCall(slug="ledger", call_id="c1", args_hash="h", mutating=True, args={"n": 1}),
        ApprovalRequested(
            approval_id="ap_1",
            slug="ledger",
            call_id="c1",
            mutating=True,
            reason="policy",
            args={"n": 1},
        ),
        ApprovalResolved(approval_id="ap_1", slug="ledger", granted=True, by="api"),
        ToolResult(slug="ledger", call_id="c1", ok=True, latency_ms=1, bytes=2, output="ok"),
        call(70, [{"type": "text", "text": "Added"}]),
        TurnEnd(
            reason="final",
            steps=2,
            duration_ms=12,
            text="Added",
            tokens=Tokens(prompt=120, output=17, cache_read=40, cache_write=9),
        ),
    ]


def failed_turn() -> list[Event]:
    """Resumed once on this node (a second attempt), then ended by an error."""
    return [
        TurnStart(source="schedule", input="nightly"),
        TurnAttempt(attempt=1, node="node-1"),
        ModelChunk(delta="Work"),
        TurnAttempt(attempt=2, node="node-1", resumed_from_step=0),
        TurnEnd(reason="error", steps=0, tokens=Tokens(), duration_ms=3,
                error=ErrorDetail(code="model_overloaded", message="busy", hint="retry")),
    ]  # fmt: skip


def noted_turn() -> list[Event]:
    return [
        TurnStart(source="api", input="note: milk"),
        TurnAttempt(attempt=1, node="node-1"),
        call(30, [{"type": "text", "text": "Noted"}]),
        TurnEnd(reason="max_steps", steps=1, tokens=Tokens(prompt=30, output=10),
                duration_ms=4, text="Noted"),
    ]  # fmt: skip


def delivered_turn() -> list[Event]:
    return [
        TurnStart(source="api", input="tell them"),
        call(30, [{"type": "text", "text": "Told"}]),
        DeliveryEnqueued(channel_id="nowhere", to="42", key=f"o_{uuid.uuid4().hex}",
                         chunk_index=0, chunk_total=1, text="Told"),
        TurnEnd(reason="final", steps=1, tokens=Tokens(prompt=30, output=10), duration_ms=4,
                text="Told"),
    ]  # fmt: skip


async def append_turn(api: ApiServer, events: list[Event], *, split: int = 0) -> str:
    """A whole turn appended through the node's writer (so its memory holds it), in one
    append, or two when ``split`` says where the second starts."""
    turn_id = "t_" + uuid.uuid4().hex[:17]
    meta = Metadata(agent_id="assistant", session_key=SESSION, turn_id=turn_id)
    new = [NewEvent(event=e, metadata=meta) for e in events]
    store = store_of(api.node)
    if split:
        await store.aappend(f"turn-{turn_id}", new[:split])
        await store.aappend(f"turn-{turn_id}", new[split:], expected_version=split - 1)
    else:
        await store.aappend(f"turn-{turn_id}", new)
    return turn_id


async def stored(api: ApiServer, turn_id: str) -> TurnResource:
    rows = await store_of(api.node).afetch(sql("turn"), {"turn_id": turn_id})
    assert len(rows) == 1
    return turn_resource(rows[0])


def as_json(resource: TurnResource | dict[str, Any]) -> Any:
    """As served: a resource is priced by the node's price table (the default one here)."""
    if isinstance(resource, TurnResource):
        resource = priced(resource, PriceTable())
    return msgspec.json.decode(msgspec.json.encode(resource))


@pytest.mark.asyncio
async def test_an_ended_turn_from_memory_is_the_projections_row(api: ApiServer) -> None:
    async with client_of(api) as http:
        # Real turns first: the node owns the session, and the scripted model runs a tool.
        real = [(await post(http, text, sessionKey=SESSION)).json()["turnId"]
                for text in ("hello", "calculate 6*7", "note: buy milk")]  # fmt: skip
        for turn_id in real:
            await ended(http, turn_id)
        made = [
            await append_turn(api, thinking_turn()),
            await append_turn(api, tool_turn(), split=4),
            await append_turn(api, failed_turn()),
            await append_turn(api, noted_turn()),
        ]
        # A note the turn wrote on its session's stream rides in memory with the turn.
        note_meta = Metadata(agent_id="assistant", session_key=SESSION, turn_id=made[-1])
        note = NewEvent(event=SessionNote(action="append", text="milk"), metadata=note_meta)
        await store_of(api.node).aappend("session-x", [note])
        for turn_id in [*real, *made]:
            from_memory = turn_in_memory(api.node.feed, turn_id)
            assert from_memory is not None, turn_id
            from_postgres = await stored(api, turn_id)
            assert from_memory == from_postgres
            served = (await http.get(f"/v1/agents/assistant/turns/{turn_id}")).json()
            assert served == as_json(from_postgres)
        thought = turn_in_memory(api.node.feed, made[0])
        assert thought is not None and thought.reasoning == "Let me think.\n\nSecond thought."
        tools = turn_in_memory(api.node.feed, made[1])
        assert tools is not None and (tools.cache_read_tokens, len(tools.calls)) == (40, 2)
        failed = turn_in_memory(api.node.feed, made[2])
        assert failed is not None and (failed.attempt, failed.error_code) == (2, "model_overloaded")
        # Another agent's turn is not found through this one, from memory or not.
        other = await http.get(f"/v1/agents/nobody/turns/{made[0]}")
        assert other.status_code == 404


@pytest.mark.asyncio
async def test_memory_answers_only_for_a_turn_held_from_its_start_with_nothing_to_deliver(
    api: ApiServer,
) -> None:
    async with client_of(api) as http:
        await ended(http, (await post(http, "hello", sessionKey=SESSION)).json()["turnId"])
        running = await append_turn(api, thinking_turn()[:-1])
        assert api.node.feed is not None and api.node.feed.whole(running) is not None
        from_memory = turn_in_memory(api.node.feed, running)
        assert from_memory is not None and from_memory.status == "running"
        assert from_memory == await stored(api, running)
        served = (await http.get(f"/v1/agents/assistant/turns/{running}")).json()
        assert served == as_json(from_memory)

        delivered = await append_turn(api, delivered_turn())
        assert turn_in_memory(api.node.feed, delivered) is None
        turn = (await http.get(f"/v1/agents/assistant/turns/{delivered}")).json()
        assert [d["channel"] for d in turn["deliveries"]] == ["nowhere"]

    # A turn whose stream memory does not hold from its first event: Postgres answers.
    held = api.node.feed.held(running) or []
    assert turn_row(held[1:]) is None
    assert turn_row(list(reversed(held))) is None
    assert turn_row([]) is None


@pytest.mark.asyncio
async def test_a_running_turn_another_node_took_over_is_read_from_postgres(
    api: ApiServer,
) -> None:
    """Memory holds the turn as this node left it, running. Another node takes the session's
    partition (raises its fence) and ends the turn; this node learns it lost the partition when
    the fence refuses its next append. From then on memory does not answer for the turn, even
    if the node wins the partition back: the turn's end is in Postgres only."""
    node, feed, ownership = api.node, api.node.feed, api.node.ownership
    assert feed is not None and ownership is not None
    async with client_of(api) as http:
        await ended(http, (await post(http, "hello", sessionKey=SESSION)).json()["turnId"])
        running = await append_turn(api, thinking_turn()[:-1])
        partition = ownership.partition("assistant", SESSION)
        epoch = ownership.epochs[partition]
        assert feed.whole(running) is not None

        store = store_of(node)
        other = EventStore(store.conninfo, schema=store.schema, inline=INLINE)  # another node
        await other.aopen()
        try:
            assert await other.araise_fences([Fence(partition, epoch + 1)]) == {
                partition: epoch + 1
            }
            meta = Metadata(agent_id="assistant", session_key=SESSION, turn_id=running)
            end = TurnEnd(reason="stopped", steps=0, tokens=Tokens(), duration_ms=1)
            version = len(thinking_turn()) - 2
            await other.aappend(f"turn-{running}", [NewEvent(event=end, metadata=meta)],
                                version, fence=Fence(partition, epoch + 1))  # fmt: skip
        finally:
            await other.aclose()

        # This node's next append under its old epoch is refused: it gives the partition up.
        with pytest.raises(Fenced):
            await store.aappend(f"session-{SESSION}-late", [NewEvent(event=end, metadata=meta)])
        for _ in range(200):
            if ownership.epochs.get(partition) != epoch:
                break
            await asyncio.sleep(0.025)
        assert ownership.epochs.get(partition) != epoch
        assert feed.held(running) is not None  # memory still holds it, as this node left it
        assert feed.whole(running) is None
        assert turn_in_memory(feed, running) is None
        turn = (await http.get(f"/v1/agents/assistant/turns/{running}")).json()
        assert turn["status"] == "stopped"


def filler(chunks: int, text: str = "") -> list[Event]:
    """An ended turn of ``chunks`` chunks: pushes older turns out of memory in few appends."""
    return [
        TurnStart(source="api", input=text or "fill"),
        *(ModelChunk(delta="x") for _ in range(chunks)),
        TurnEnd(reason="final", steps=0, tokens=Tokens(), duration_ms=1, text="x" * chunks),
    ]


@pytest.mark.asyncio
async def test_an_ended_turn_is_still_served_from_memory_once_its_events_go(
    api: ApiServer,
) -> None:
    """Memory holds the newest turns' events (``_RECENT_EVENTS``); when it lets a turn's go, an
    ended turn keeps its final row: a poll of it is still no query, and still the projection's
    row. A running turn, or one that promised a delivery, is not kept: Postgres answers."""
    feed = api.node.feed
    assert feed is not None
    async with client_of(api) as http:
        real = (await post(http, "calculate 6*7", sessionKey=SESSION)).json()["turnId"]
        await ended(http, real)
        kept = [
            real,
            await append_turn(api, thinking_turn()),
            await append_turn(api, tool_turn(), split=4),
            await append_turn(api, failed_turn()),
        ]
        running = await append_turn(api, thinking_turn()[:-1])
        delivered = await append_turn(api, delivered_turn())
        for _ in range(_RECENT_EVENTS // 200 + 1):
            await append_turn(api, filler(198))
        for turn_id in [*kept, running, delivered]:
            assert feed.held(turn_id) is None, turn_id
        for turn_id in kept:
            assert feed.ended(turn_id) is not None, turn_id
            from_postgres = await stored(api, turn_id)
            assert turn_in_memory(feed, turn_id) == from_postgres
            served = (await http.get(f"/v1/agents/assistant/turns/{turn_id}")).json()
            assert served == as_json(from_postgres)
        assert (await http.get(f"/v1/agents/nobody/turns/{kept[0]}")).status_code == 404
        for turn_id in (running, delivered):
            assert feed.ended(turn_id) is None and turn_in_memory(feed, turn_id) is None
        turn = (await http.get(f"/v1/agents/assistant/turns/{running}")).json()
        assert turn["status"] == "running"
        turn = (await http.get(f"/v1/agents/assistant/turns/{delivered}")).json()
        assert [d["channel"] for d in turn["deliveries"]] == ["nowhere"]


@pytest.mark.asyncio
async def test_the_ended_turns_memory_keeps_is_bounded_by_their_size(api: ApiServer) -> None:
    """Big turns (256 KiB of input each): memory keeps the newest of them within
    ``_ENDED_BYTES``, and lets the oldest go first."""
    feed = api.node.feed
    assert feed is not None
    big = "y" * (256 << 10)
    turns = [await append_turn(api, filler(1, big)) for _ in range(_ENDED_BYTES // len(big) + 8)]
    kept = [turn_id for turn_id in turns if feed.ended(turn_id) is not None]
    assert 0 < len(kept) < len(turns)
    assert kept == turns[len(turns) - len(kept) :]  # the newest
    assert len(kept) * len(big) <= _ENDED_BYTES < (len(kept) + 1) * (len(big) + 1000)
    from_memory = turn_in_memory(feed, kept[0])
    assert from_memory is not None and from_memory == await stored(api, kept[0])


@pytest.mark.asyncio
async def test_an_ended_turns_row_is_kept_from_its_end_and_dropped_if_anything_follows(
    api: ApiServer,
) -> None:
    """The final row is folded once, at the ``turn.end``, and answers while the events are
    still held too. Nothing follows a turn's end; an event that does (written here straight
    to the stream) makes memory stop answering for the turn: Postgres says what it is."""
    feed = api.node.feed
    assert feed is not None
    turn_id = await append_turn(api, noted_turn())
    assert feed.held(turn_id) is not None and feed.ended(turn_id) is not None
    assert turn_in_memory(feed, turn_id) == await stored(api, turn_id)
    running = await append_turn(api, noted_turn()[:-1])
    assert feed.ended(running) is None

    meta = Metadata(agent_id="assistant", session_key=SESSION, turn_id=turn_id)
    late = NewEvent(event=ModelChunk(delta="late"), metadata=meta)
    await store_of(api.node).aappend(f"turn-{turn_id}", [late], len(noted_turn()) - 1)
    assert feed.ended(turn_id) is None and turn_in_memory(feed, turn_id) is None
    async with client_of(api) as http:
        served = (await http.get(f"/v1/agents/assistant/turns/{turn_id}")).json()
    assert served == as_json(await stored(api, turn_id))
    assert served["status"] == "max_steps"
