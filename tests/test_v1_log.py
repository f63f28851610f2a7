"""A log written before catalogue v2 (tests/fixtures/v1_log.jsonl: four turns of the default
agent in two sessions, two with a tool call, dumped from a node at b7de1ad, the last commit
before v2) is read, projected and replayed as it was: its rows, inserted as they were stored,
rebuild into the projections the v1 node had made (tests/fixtures/v1_log_turns.json); the
context replay rebuilds every model call; a new turn on its session reads its history; and a
reader resuming at any of its cursors gets the rest of the log once, in order."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from eventstore import INLINE, START, EventStore, RecordedEvent, rebuild
from eventstore.catalogue import ContextAssembled, ContextPressure, ModelCall
from eventstore.upcast import upcast
from tests.conftest import ConnectFactory, NodeFactory
from tests.turns import send, turn_row, wait_end

FIXTURES = Path(__file__).parent / "fixtures"


def v1_rows() -> list[dict[str, Any]]:
    lines = (FIXTURES / "v1_log.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def insert_v1(connect: ConnectFactory) -> None:
    """The fixture's rows into the events table byte for byte as v1 stored them (not through
    our append, which would write them with v2's codec)."""
    with connect() as conn:
        for row in v1_rows():
            conn.execute(
                """INSERT INTO events (stream_id, stream_version, event_id, type, data, metadata,
                                       recorded_at)
                   VALUES (%s, %s, %s, %s, %s::jsonb, %s::jsonb, %s)""",
                [row["stream"], row["version"], row["id"], row["type"], json.dumps(row["data"]),
                 json.dumps(row["metadata"]), row["recordedAt"]],
            )  # fmt: skip
        conn.commit()


def whole_log(store: EventStore) -> list[RecordedEvent]:
    events: list[RecordedEvent] = []
    while page := store.read_all(events[-1].checkpoint if events else START, 1000):
        events.extend(page)
    return events


def test_the_fixture_is_a_v1_log() -> None:
    """What the rest of this module reads: v1's three events per model call, and no v2 field."""
    rows = v1_rows()
    types = [r["type"] for r in rows]
    calls = types.count("model.call")
    assert calls == 6 and types.count("context.assembled") == types.count("context.pressure") == 6
    assert types.count("turn.attempt") == types.count("turn.start") == 4
    assert not any("context" in r["data"] for r in rows if r["type"] == "model.call")
    assert not any("attempt" in r["data"] for r in rows if r["type"] == "turn.start")


def test_a_v1_log_rebuilds_the_projections_v1_made(store: EventStore,
                                                   connect: ConnectFactory) -> None:  # fmt: skip
    insert_v1(connect)
    for projection in INLINE:
        rebuild(store, projection, inline=True)
    expected = json.loads((FIXTURES / "v1_log_turns.json").read_text())
    with connect() as conn:
        rows = conn.execute(
            """SELECT turn_id, status, state, steps, attempt, prompt_tokens, output_tokens, text
                 FROM turns ORDER BY started_at"""
        ).fetchall()
        messages = conn.execute(
            "SELECT session_key, count(*) FROM messages GROUP BY 1 ORDER BY 1"
        ).fetchall()
        sessions = conn.execute("SELECT count(*) FROM sessions").fetchone()
    keys = ["turnId", "status", "state", "steps", "attempt", "promptTokens", "outputTokens", "text"]
    assert [dict(zip(keys, row, strict=True)) for row in rows] == expected
    assert messages == [("s1", 8), ("s2", 4)]
    assert sessions == (2,)


def test_upcasting_a_v1_log_gives_one_model_call_per_call_with_its_context(
    store: EventStore, connect: ConnectFactory
) -> None:
    insert_v1(connect)
    log = whole_log(store)
    read = upcast(log)
    assert len(read) == len(log) - 12  # each call's two context events folded into it
    assert not any(isinstance(e.data, ContextAssembled | ContextPressure) for e in read)
    calls = [e for e in read if isinstance(e.data, ModelCall)]
    assert len(calls) == 6
    originals = {e.event_id: e for e in log}
    for call in calls:
        assert isinstance(call.data, ModelCall)
        assert call.data.context is not None and call.data.pressure is not None
        stored = originals[call.event_id]  # the model.call's own place in the log
        assert (stored.position, stored.version, stored.type) == (
            call.position, call.version, "model.call",
        )  # fmt: skip
        before = [e for e in log if e.stream == call.stream and e.version < call.version]
        assembled, pressure = before[-2].data, before[-1].data
        assert isinstance(assembled, ContextAssembled) and isinstance(pressure, ContextPressure)
        assert call.data.context.slots == assembled.slots
        assert call.data.context.total == assembled.total
        assert call.data.pressure.fraction == pressure.fraction


def test_a_reader_resuming_at_any_cursor_of_a_v1_log_gets_the_rest_once(
    store: EventStore, connect: ConnectFactory
) -> None:
    insert_v1(connect)
    log = whole_log(store)
    assert len(log) == len(v1_rows())
    for index, event in enumerate(log):
        rest: list[RecordedEvent] = []
        after = event.checkpoint
        while page := store.read_all(after, 7):
            rest.extend(page)
            after = page[-1].checkpoint
        assert [e.event_id for e in rest] == [e.event_id for e in log[index + 1 :]]


@pytest.mark.asyncio
async def test_a_node_on_a_v1_log_replays_its_turns_and_goes_on_with_its_sessions(
    store: EventStore, connect: ConnectFactory, node_factory: NodeFactory
) -> None:
    def loaded() -> None:
        insert_v1(connect)
        for projection in INLINE:
            rebuild(store, projection, inline=True)

    await asyncio.to_thread(loaded)
    turns = json.loads((FIXTURES / "v1_log_turns.json").read_text())
    node = await node_factory.start()
    engine = node.engine
    assert engine is not None
    for turn in turns:
        replayed = await engine.turn_context("assistant", turn["turnId"])
        steps = getattr(replayed, "steps", None)
        assert steps is not None and len(steps) == turn["steps"], (turn, replayed)
    # The first turn of s1 said hello; a turn now on s1 reads the v1 history before it.
    accepted = await send(node, "assistant", "one more", session="s1")
    events = await wait_end(node, accepted.turn_id)
    row = await turn_row(node, accepted.turn_id)
    assert row["status"] == "final" and row["attempt"] == 1
    (call,) = [e.data for e in events if isinstance(e.data, ModelCall)]
    assert call.context is not None and call.pressure is not None
    labels = [slot.label for slot in call.context.slots]
    assert "history" in labels, labels
    first = next(t for t in turns if t["text"])
    assert call.prompt_tokens > first["promptTokens"]
