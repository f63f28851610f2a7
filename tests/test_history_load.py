"""A session's history as a turn reads it from the read models (actors/context/load.py and
sql/history.sql): the rows of the turns that ran and ended, in acceptance order; how the last
of them ended; its notes; and only what came before the turn asking (``before``)."""

from __future__ import annotations

import uuid

import pytest

from actors.context.load import load
from eventstore import AppendResult, Metadata, NewEvent, streams
from eventstore.catalogue import (
    ErrorDetail,
    ModelResult,
    SessionNote,
    Tokens,
    TurnAttempt,
    TurnEnd,
    TurnStart,
)
from eventstore.event import Event
from tests.conftest import ApiServer
from tests.turns import store_of

AGENT = "assistant"


def turn(text: str, answer: str, end: TurnEnd, *, ran: bool = True) -> list[Event]:
    reply = ModelResult(prompt_tokens=10, output_tokens=5, finish_reason="end_turn",
                        latency_ms=1, text=answer,
                        content=[{"type": "text", "text": answer}])  # fmt: skip
    if not ran:  # stopped before it began: no attempt, no history
        return [TurnStart(source="api", input=text), end]
    return [TurnStart(source="api", input=text), TurnAttempt(attempt=1, node="n"), reply, end]


def final(answer: str) -> TurnEnd:
    return TurnEnd(reason="final", steps=1, tokens=Tokens(prompt=10, output=5), duration_ms=2,
                   text=answer)  # fmt: skip


async def append(api: ApiServer, session: str, events: list[Event]) -> AppendResult:
    turn_id = "t_" + uuid.uuid4().hex[:17]
    meta = Metadata(agent_id=AGENT, session_key=session, turn_id=turn_id)
    new = [NewEvent(event=e, metadata=meta) for e in events]
    return await store_of(api.node).aappend(f"turn-{turn_id}", new)


@pytest.mark.asyncio
async def test_a_sessions_history_from_the_read_models(api: ApiServer) -> None:
    store = store_of(api.node)
    session = f"history-{uuid.uuid4().hex[:8]}"
    empty = await load(store, AGENT, session)
    assert (empty.entries, empty.notes, empty.last_error, empty.view.digest) == ([], (), None, None)

    first = await append(api, session, turn("hello", "Hi", final("Hi")))
    failed_end = TurnEnd(reason="max_steps", steps=1, tokens=Tokens(), duration_ms=3,
                         error=ErrorDetail(code="max_steps", message="too many steps",
                                           hint="raise it"))  # fmt: skip
    second = await append(api, session, turn("count", "One, two", failed_end))
    await append(api, session, turn("never ran", "", final(""), ran=False))
    meta = Metadata(agent_id=AGENT, session_key=session)
    await store.aappend(streams.session(AGENT, session),
                        [NewEvent(event=SessionNote(action="append", text="likes tea"),
                                  metadata=meta)])  # fmt: skip

    history = await load(store, AGENT, session)
    rows = [(e.turn_id, e.role) for e in history.entries]
    ids = [first.events[0].metadata.turn_id, second.events[0].metadata.turn_id]
    assert rows == [(ids[0], "user"), (ids[0], "assistant"), (ids[1], "user"),
                    (ids[1], "assistant")]  # fmt: skip
    assert [e.start for e in history.entries] == [first.events[0].position] * 2 + [
        second.events[0].position
    ] * 2
    assert history.last_error is not None and "max_steps" in history.last_error
    assert "too many steps" in history.last_error
    assert history.notes == ("likes tea",)

    # The history the second turn read: the first turn only, which ended well.
    before = await load(store, AGENT, session, second.events[0].position)
    assert [(e.turn_id, e.role) for e in before.entries] == rows[:2]
    assert before.last_error is None
