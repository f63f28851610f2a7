"""eventstore/upcast.py, table by table: a v1 model call (``context.assembled``,
``context.pressure``, ``model.call``) reads as v2's one ``model.call``; everything else reads as
stored."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from eventstore import Metadata, RecordedEvent
from eventstore.catalogue import (
    ContextAssembled,
    ContextPressure,
    ContextSlot,
    ContextView,
    ModelCall,
    ModelResult,
    Pressure,
    Tokens,
    TurnEnd,
    TurnStart,
)
from eventstore.event import Event
from eventstore.upcast import upcast

SLOTS = [ContextSlot(slot=0, label="input", tokens=5, pinned=False)]
ASSEMBLED = ContextAssembled(slots=SLOTS, total=5, budget=100, window=200, breakpoints=1)
PRESSURE = ContextPressure(fraction=0.05, tokens=5, budget=100, source="estimated")
CALL = ModelCall(role="main", model="m", prompt_tokens=5)
V2_CALL = ModelCall(
    role="main", model="m", prompt_tokens=5,
    context=ContextView(slots=SLOTS, total=5, budget=100, window=200, breakpoints=1),
    pressure=Pressure(fraction=0.05, tokens=5, budget=100, source="estimated"),
)  # fmt: skip
START = TurnStart(source="api", input="hi")
RESULT = ModelResult(output_tokens=1, prompt_tokens=5, finish_reason="end_turn", latency_ms=0)
END = TurnEnd(reason="final", steps=1, tokens=Tokens(), duration_ms=1)


def recorded(events: list[tuple[str, Event]]) -> list[RecordedEvent]:
    """Events of the given streams in this order, each stream's versions counting from 0."""
    versions: dict[str, int] = {}
    out = []
    for position, (stream, data) in enumerate(events):
        versions[stream] = versions.get(stream, -1) + 1
        out.append(RecordedEvent(
            stream=stream, version=versions[stream], position=position, txid=1,
            event_id=uuid.UUID(int=position), type=data.TYPE, data=data,
            metadata=Metadata(turn_id=stream), recorded_at=datetime.now(UTC),
        ))  # fmt: skip
    return out


def shape(events: list[RecordedEvent]) -> list[tuple[str, int, Event]]:
    return [(e.stream, e.position, e.data) for e in events]  # type: ignore[misc]


ROWS = [
    pytest.param(
        [("a", START), ("a", ASSEMBLED), ("a", PRESSURE), ("a", CALL), ("a", RESULT), ("a", END)],
        [("a", 0, START), ("a", 3, V2_CALL), ("a", 4, RESULT), ("a", 5, END)],
        id="a-v1-call-becomes-one-v2-call-at-its-own-position",
    ),
    pytest.param(
        [("a", START), ("a", V2_CALL), ("a", RESULT)],
        [("a", 0, START), ("a", 1, V2_CALL), ("a", 2, RESULT)],
        id="v2-reads-as-stored",
    ),
    pytest.param(
        [("a", ASSEMBLED), ("a", PRESSURE), ("a", END)],
        [("a", 0, ASSEMBLED), ("a", 1, PRESSURE), ("a", 2, END)],
        id="over-budget-never-sent-stays",
    ),
    pytest.param(
        [("a", ASSEMBLED), ("a", PRESSURE), ("a", CALL), ("a", RESULT), ("a", CALL)],
        [("a", 2, V2_CALL), ("a", 3, RESULT), ("a", 4, CALL)],
        id="a-cut-off-reply-asked-again-reads-the-same-context-so-carries-none",
    ),
    pytest.param(
        [("a", ASSEMBLED), ("b", START), ("a", PRESSURE), ("a", CALL)],
        [("a", 0, ASSEMBLED), ("b", 1, START), ("a", 2, PRESSURE), ("a", 3, CALL)],
        id="only-one-streams-consecutive-events-fold",
    ),
    pytest.param(
        [("a", ASSEMBLED), ("a", PRESSURE), ("b", CALL)],
        [("a", 0, ASSEMBLED), ("a", 1, PRESSURE), ("b", 2, CALL)],
        id="another-streams-call-takes-nothing",
    ),
    pytest.param(
        [("a", START), ("a", ASSEMBLED), ("a", PRESSURE)],
        [("a", 0, START), ("a", 1, ASSEMBLED), ("a", 2, PRESSURE)],
        id="a-read-cut-before-the-call-keeps-what-it-has",
    ),
    pytest.param(
        [("a", ASSEMBLED), ("a", ASSEMBLED), ("a", PRESSURE), ("a", CALL)],
        [("a", 0, ASSEMBLED), ("a", 3, V2_CALL)],
        id="the-last-context-before-the-call-is-its-own",
    ),
]


@pytest.mark.parametrize(("stored", "read"), ROWS)
def test_upcast(stored: list[tuple[str, Event]], read: list[tuple[str, int, Event]]) -> None:
    assert shape(upcast(recorded(stored))) == read


def test_a_folded_call_keeps_its_own_identity() -> None:
    stored = recorded([("a", ASSEMBLED), ("a", PRESSURE), ("a", CALL)])
    (call,) = upcast(stored)
    assert (call.event_id, call.version, call.position, call.type) == (
        stored[2].event_id, 2, 2, "model.call",
    )  # fmt: skip
