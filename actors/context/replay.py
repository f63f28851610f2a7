"""Rebuilding, from the log alone, exactly what a past turn sent the model at each step.

Compaction never rewrites the stored history: a ``compaction.stage`` event records what each rung
marked or the digest it wrote. Folding the session's events up to the turn (its earlier turns'
rows, their compaction stages, its notes, a clear) gives the history the turn started from; then
the turn's own events, replayed in order, give the request of every ``context.assembled``. The
pinned blocks come from the agent as it is loaded now: a manifest edited since the turn ran
changes them (and so the replay).
"""

from __future__ import annotations

from collections import defaultdict
from importlib import resources
from typing import Any

from actors.agent import Agent
from actors.context.assemble import assemble
from actors.context.compact import digest_of
from actors.context.history import Entry, History, after_stage, entry
from actors.context.load import last_error_line
from actors.tools import notes as session_notes
from actors.turn.core import TurnState, apply
from eventstore import EventStore, RecordedEvent, streams
from eventstore.catalogue import (
    CompactionStage,
    ContextAssembled,
    ModelResult,
    SessionCleared,
    ToolResult,
    TurnAttempt,
    TurnEnd,
    TurnStart,
)
from eventstore.projections import history_row

_TYPES = [t.TYPE for t in (TurnStart, TurnAttempt, ModelResult, ToolResult, TurnEnd,
                           CompactionStage)]  # fmt: skip
_PAGE = 1000
_EARLIER = resources.files("actors.context").joinpath("sql/earlier_turns.sql").read_text().encode()


async def replay(store: EventStore, agent: Agent, turn_id: str) -> list[dict[str, Any]] | None:
    """Each model call of the turn as it was sent (``system``, ``tools``, ``messages``), in
    order; None if there is no such turn."""
    own = await store.aread_stream(streams.turn(turn_id))
    if not own or not isinstance(own[0].data, TurnStart):
        return None
    meta = own[0].metadata
    start = own[0].position
    session = await _session_events(store, meta.agent_id or "", meta.session_key or "", start)
    history = _history_before(session, start)
    requests: list[dict[str, Any]] = []
    state = TurnState()
    for event in own:
        data = event.data
        if isinstance(data, TurnAttempt):
            history.notes = _notes_before(session, event.position)
        elif isinstance(data, CompactionStage):
            _apply_stage(history, data)
        elif isinstance(data, ContextAssembled):
            built = assemble(agent.pinned, history, state.input, state.transcript,
                             agent.context.excerpt_keep)  # fmt: skip
            requests.append({"system": built.system, "tools": agent.pinned.tools,
                             "messages": built.messages})  # fmt: skip
        state = apply(state, data, version=event.version, turn_id=turn_id)
    return requests


async def _session_events(
    store: EventStore, agent_id: str, session_key: str, start: int
) -> list[RecordedEvent]:
    """What shaped the context of the session's turn accepted at ``start``: the events of its
    earlier turns (through the turn index) and the session's own stream (notes, clears), in
    log order. O(session), never a scan of the log."""
    key = {"agent_id": agent_id, "session_key": session_key, "before": start}
    earlier = [turn_id for (turn_id,) in await store.afetch(_EARLIER, key)]
    found = await store.aread_turns(earlier, _TYPES) if earlier else []
    stream, version = streams.session(agent_id, session_key), 0
    while True:
        page = await store.aread_stream(stream, version, _PAGE)
        found.extend(page)
        if len(page) < _PAGE:
            return sorted(found, key=lambda e: e.position)
        version = page[-1].version + 1


def _history_before(session: list[RecordedEvent], start: int) -> History:
    """The history a turn accepted at log position ``start`` read (turns run one at a time, so
    every earlier turn that ran had ended)."""
    cleared = max((e.position for e in session if isinstance(e.data, SessionCleared)
                   and e.position < start), default=-1)  # fmt: skip
    starts: dict[str, int] = {}
    ran: set[str] = set()
    ends: dict[str, TurnEnd] = {}
    by_turn: dict[str, list[RecordedEvent]] = defaultdict(list)
    for event in session:
        turn = event.metadata.turn_id
        if turn is None:
            continue
        if isinstance(event.data, TurnStart):
            starts[turn] = event.position
        by_turn[turn].append(event)
        if isinstance(event.data, TurnAttempt):
            ran.add(turn)
        elif isinstance(event.data, TurnEnd):
            ends[turn] = event.data
    earlier = sorted((s, t) for t, s in starts.items()
                     if cleared < s < start and t in ran and t in ends)  # fmt: skip
    history = History()
    entries: list[Entry] = []
    stages: list[tuple[int, CompactionStage]] = []
    for turn_start, turn in earlier:
        for event in by_turn[turn]:
            row = history_row(event.data)
            if row is not None:
                entries.append(entry(turn, turn_start, row[0], row[1]))
            if isinstance(event.data, CompactionStage):
                stages.append((event.position, event.data))
    history.entries = entries
    for _, stage in sorted(stages, key=lambda s: s[0]):
        _apply_stage(history, stage)
    if earlier:
        end = ends[earlier[-1][1]]
        error = end.error
        history.last_error = last_error_line(end.reason, error.code if error else None,
                                             error.message if error else None)  # fmt: skip
    return history


def _apply_stage(history: History, stage: CompactionStage) -> None:
    digest = digest_of(stage)
    history.view = after_stage(history.view, stage.stage, stage.ids, digest,
                               stage.kept)  # type: ignore[arg-type]  # fmt: skip
    if digest is not None:
        history.entries = [e for e in history.entries if e.start > digest.through]


def _notes_before(session: list[RecordedEvent], position: int) -> tuple[str, ...]:
    notes: tuple[str, ...] = ()
    for event in session:
        if event.position >= position:
            break
        notes = session_notes.evolve(notes, event.data)
    return notes
