"""The compaction rungs' registry (actors/context/rungs.py) and what is derived from it, or kept
literal and checked against it: the policy's defaults, the manifest's ``context.thresholds``, the
context view's ``thresholds`` and ``compacted`` (actors/messages.py), and the session_context
projection, which names no rung and must fold every rung's event as the engine does."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from actors.context import rungs
from actors.context.compact import Digester
from actors.context.history import Digest, Entry, History, entry
from actors.context.policy import ContextPolicy
from actors.messages import Compacted, ContextThresholds
from eventstore import EventStore, Metadata
from eventstore.catalogue import CompactionStage
from eventstore.envelope import RecordedEvent
from eventstore.projections.context import SessionContextProjection
from eventstore.projector import run_statements, statements_for
from runtime.manifest_schema import ContextConfig, ThresholdsConfig
from tests.conftest import ConnectFactory


def test_each_rung_is_declared_once_with_a_rising_threshold_in_0_1() -> None:
    names = [rung.name for rung in rungs.RUNGS]
    assert len(set(names)) == len(names)
    assert tuple(names) == rungs.STAGES
    thresholds = rungs.DEFAULT_THRESHOLDS
    assert all(0 < t < 1 for t in thresholds)
    assert all(a < b for a, b in itertools.pairwise(thresholds))
    assert ContextPolicy().thresholds == thresholds
    assert tuple(r.name for r in rungs.RUNGS if r.marking is not None) == rungs.MARKS
    assert set(rungs.MARKS) >= rungs.SLIMMED


def test_the_manifest_thresholds_are_the_rungs_with_their_defaults() -> None:
    assert ThresholdsConfig.__struct_fields__ == rungs.STAGES
    assert msgspec.structs.astuple(ThresholdsConfig()) == rungs.DEFAULT_THRESHOLDS
    for name in rungs.STAGES:  # each a fraction in (0, 1), named in the error
        with pytest.raises(msgspec.ValidationError, match=rf"\$\.thresholds\.{name}"):
            msgspec.json.decode(b'{"thresholds": {"%s": 1.0}}' % name.encode(), type=ContextConfig)
    with pytest.raises(msgspec.ValidationError, match="unknown field `trim`"):
        msgspec.json.decode(b'{"thresholds": {"trim": 0.5}}', type=ContextConfig)


def test_the_context_views_literals_agree_with_the_registry() -> None:
    # msgspec types the gateways import without the engine: literal, so checked here. A new
    # rung adds its field to ContextThresholds (and, marking, to Compacted).
    assert ContextThresholds.__struct_fields__ == rungs.STAGES
    assert Compacted.__struct_fields__ == rungs.MARKS


# --- every rung through the projection -----------------------------------------------------------


def session(turns: int) -> list[Entry]:
    """Turns whose lookups repeat (dedupe), some with big results (excerpt, stub), and enough
    of them for a digest that keeps two."""
    entries = []
    for i in range(turns):
        t, start, call_id = f"t{i}", 10 * (i + 1), f"c{i}"
        blocks = [{"type": "tool_use", "id": call_id, "name": "lookup", "input": {"q": i % 2}}]
        size = 8000 if i % 2 else 600
        entries += [
            entry(t, start, "user", {"type": "text", "text": f"request {i}"}),
            entry(t, start, "assistant", blocks),
            entry(
                t,
                start,
                "tool",
                {"type": "tool_result", "tool_use_id": call_id, "content": str(i) * size},
            ),
            entry(t, start, "assistant", [{"type": "text", "text": f"answer {i}"}]),
        ]
    return entries


async def ladder_events(history: History, policy: ContextPolicy) -> list[CompactionStage]:
    """Each rung applied in turn (all it can), as the events it would record."""
    events = []
    for rung in rungs.RUNGS:
        fields = await rung.apply(history, policy, 10**9, Digester())
        assert fields["changed"], f"{rung.name} found nothing to compact in the test's session"
        events.append(CompactionStage(**{**fields, "stage": rung.name, "before": 2, "after": 1}))
    return events


def projected(connect: ConnectFactory, events: list[CompactionStage]) -> tuple[Any, Any]:
    key = f"s-{uuid.uuid4().hex[:8]}"
    meta = Metadata(agent_id="a", session_key=key, turn_id="t9")
    at = datetime(2026, 12, 7, tzinfo=UTC)
    recorded = [RecordedEvent("turn-t9", v, 1000 + v, 1, uuid.uuid4(), CompactionStage.TYPE, e,
                              meta, at) for v, e in enumerate(events)]  # fmt: skip
    with connect(autocommit=True) as conn, conn.cursor() as cur:
        run_statements(cur, statements_for([SessionContextProjection()], recorded))
        row = conn.execute("SELECT digest, marks FROM session_context WHERE session_key = %s",
                           [key]).fetchone()  # fmt: skip
    return (None, {}) if row is None else (row[0], row[1])


@pytest.mark.parametrize("upto", range(1, len(rungs.RUNGS) + 1))
def test_the_projection_folds_each_rungs_event_as_the_engine_replays_it(
    store: EventStore, connect: ConnectFactory, upto: int
) -> None:
    policy = ContextPolicy(window=10_000, reserve_output=1000, excerpt_over=800, excerpt_keep=200)
    start = History(entries=session(8))
    events = asyncio.run(ladder_events(start.copy(), policy))[:upto]
    replayed = start.copy()
    for event in events:
        decoded = msgspec.json.decode(msgspec.json.encode(event), type=CompactionStage)
        rungs.replay(replayed, decoded)
    digest, marks = projected(connect, events)
    assert marks == replayed.view.marks
    if replayed.view.digest is None:
        assert digest is None
    else:
        assert msgspec.convert(digest, Digest) == replayed.view.digest
    marking = [e for e in events if rungs.BY_NAME[e.stage].marks]
    assert all(e.ids and e.text is None for e in marking)  # what the projection reads them by
