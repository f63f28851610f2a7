"""The turns projection says a commit's run of one turn's updates in one UPDATE
(eventstore/projections/turns.py ``TurnsProjection.statements_many``): on real Postgres, the rows it
leaves equal those of one statement per event, however the turn's events are cut into
commits and whatever other turns' events share them."""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from eventstore import EventStore, Metadata
from eventstore.catalogue import (
    ApprovalRequested,
    ContextAssembled,
    ModelCall,
    ModelChunk,
    Tokens,
    TurnAttempt,
    TurnEnd,
    TurnStart,
)
from eventstore.envelope import RecordedEvent
from eventstore.event import Event, type_name
from eventstore.projections.turns import TurnsProjection
from eventstore.projector import run_statements, statements_for
from tests.conftest import ConnectFactory
from tests.test_stream_reasoning import call, thinking_turn
from tests.test_turn_memory import failed_turn, noted_turn, tool_turn

TURNS = TurnsProjection()
COMPARED = """SELECT status, state, source, input, text, reasoning, steps, attempt,
                     prompt_tokens, output_tokens, cache_read_tokens, cache_write_tokens,
                     error_code, error_message, error_hint, duration_ms, calls,
                     last_position - start_position, ended_at - started_at
                FROM turns WHERE turn_id = %s"""


def plain_turn() -> list[Event]:
    return [
        TurnStart(source="api", input="hello"),
        TurnAttempt(attempt=1, node="n1"),
        ContextAssembled(slots=[], total=10),
        ModelCall(role="main", model="m", prompt_tokens=10, cached=False, attempt=1),
        ModelChunk(delta="Hi"),
        call(10, [{"type": "text", "text": "Hi"}]),
        TurnEnd(reason="final", steps=1, tokens=Tokens(prompt=10, output=10), duration_ms=3,
                text="Hi"),
    ]  # fmt: skip


def waiting_turn() -> list[Event]:
    """Still running: resumed, two calls (one thinking), then an approval asked."""
    return [
        TurnStart(source="api", input="do it"),
        TurnAttempt(attempt=1, node="n1"),
        call(20, [{"type": "text", "text": "First"}]),
        TurnAttempt(attempt=2, node="n2", resumed_from_step=1),
        call(30, [THOUGHT, {"type": "text", "text": "Then"}], "tool_use"),
        ApprovalRequested(
            approval_id="ap_9", slug="ledger", call_id="c9", mutating=True, reason="policy"
        ),
    ]


THOUGHT: dict[str, object] = {"type": "thinking", "thinking": "Hmm.", "signature": "s"}


KINDS = {
    "plain": plain_turn,
    "tool": tool_turn,
    "thinking": thinking_turn,
    "failed": failed_turn,
    "noted": noted_turn,
    "waiting": waiting_turn,
}


def recorded(turn_id: str, events: list[Event], first: int) -> list[RecordedEvent]:
    meta = Metadata(agent_id="a", session_key="s", turn_id=turn_id)
    at = datetime(2026, 12, 6, tzinfo=UTC)
    return [
        RecordedEvent(f"turn-{turn_id}", version, first + version, 1, uuid.uuid4(),
                      type_name(event), event, meta, at + timedelta(milliseconds=version))
        for version, event in enumerate(events)
    ]  # fmt: skip


def apply(conn: psycopg.Connection[Any], commits: list[list[RecordedEvent]]) -> None:
    with conn.cursor() as cur:
        for commit in commits:
            run_statements(cur, statements_for([TURNS], commit))


def row(conn: psycopg.Connection[Any], turn_id: str) -> tuple[Any, ...]:
    found = conn.execute(COMPARED, [turn_id]).fetchone()
    assert found is not None
    return tuple(found)


def cuts(n: int) -> list[list[int]]:
    """Every way to cut n events into at most three commits (cut points, in order)."""
    points = range(1, n)
    return [[], *([p] for p in points), *(list(c) for c in itertools.combinations(points, 2))]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_turns_row_is_the_same_however_its_events_are_committed(
    store: EventStore, connect: ConnectFactory, kind: str
) -> None:
    events = KINDS[kind]()
    with connect(autocommit=True) as conn:
        one_each = f"t_{uuid.uuid4().hex[:12]}"
        apply(conn, [[e] for e in recorded(one_each, events, 1000)])
        expected = row(conn, one_each)
        for points in cuts(len(events)):
            turn_id = f"t_{uuid.uuid4().hex[:12]}"
            stored = recorded(turn_id, events, 1000)
            bounds = [0, *points, len(events)]
            apply(conn, [stored[a:b] for a, b in itertools.pairwise(bounds)])
            assert row(conn, turn_id) == expected, (kind, points)


def test_turns_sharing_a_commit_are_each_folded_alone(
    store: EventStore, connect: ConnectFactory
) -> None:
    """Commits hold several turns' appends, each command's events together (the writer's
    batch): every turn's row comes out as if it had been committed alone."""
    kinds = sorted(KINDS)
    with connect(autocommit=True) as conn:
        alone, together = {}, []
        for n, kind in enumerate(kinds):
            turn_id = f"t_{uuid.uuid4().hex[:12]}"
            apply(conn, [[e] for e in recorded(turn_id, KINDS[kind](), 10_000 * (n + 1))])
            alone[kind] = row(conn, turn_id)
        starts, rests = [], []
        ids = {kind: f"t_{uuid.uuid4().hex[:12]}" for kind in kinds}
        for n, kind in enumerate(kinds):
            stored = recorded(ids[kind], KINDS[kind](), 10_000 * (n + 1))
            starts.append(stored[0])
            rests.extend(stored[1:])
        together = [starts, rests]
        apply(conn, together)
        for kind in kinds:
            assert row(conn, ids[kind]) == alone[kind], kind
