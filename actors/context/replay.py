"""Rebuilding, from the log alone, exactly what a past turn sent the model at each step.

Compaction never rewrites the stored history: a ``compaction.stage`` event records what each rung
marked or the digest it wrote. Folding the session's events up to the turn (its earlier turns'
rows, their compaction stages, its notes, a clear, the fork it started from) gives the history
the turn started from; then the turn's own events, replayed in order, give the request of every
``model.call`` (``context.assembled`` in a v1 log). The pinned blocks come from the agent as it
is loaded now: a manifest edited since the turn ran changes them (and so the replay).
"""

from __future__ import annotations

from collections import defaultdict
from importlib import resources
from typing import Any

from actors import phases
from actors.agent import Agent
from actors.context import rungs
from actors.context.assemble import assemble
from actors.context.history import Entry, History, entry
from actors.context.load import last_error_line
from actors.recall import NOTHING, resolve
from actors.tools import notes as session_notes
from actors.turn.core import TurnState, apply
from eventstore import EventStore, RecordedEvent, streams
from eventstore.catalogue import (
    CompactionStage,
    ContextAssembled,
    ModelCall,
    ModelResult,
    PhaseChanged,
    SessionCleared,
    SessionForked,
    SkillNone,
    SkillSelected,
    ToolResult,
    TurnAttempt,
    TurnEnd,
    TurnStart,
)
from eventstore.projections.sessions import history_row
from eventstore.upcast import upcast

_TYPES = [t.TYPE for t in (TurnStart, TurnAttempt, ModelResult, ToolResult, TurnEnd,
                           CompactionStage, PhaseChanged)]  # fmt: skip
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
    history = _history_before(session, start, await _fork_starts(store, session))
    requests: list[dict[str, Any]] = []
    state = TurnState()
    phase: str | None = None  # the session's when the run began, as the runner reads it
    recalled = NOTHING
    for event in upcast(own):
        data = event.data
        if isinstance(data, TurnAttempt) or (isinstance(data, TurnStart) and data.attempt):
            history.notes = _notes_before(session, event.position)
            phase = _phase_before(session, event.position)
        elif isinstance(data, CompactionStage):
            rungs.replay(history, data)
        elif isinstance(data, SkillSelected | SkillNone):
            recalled = await resolve(store, agent.id, agent.recall, history.notes, data)
        elif _request(data):
            pinned = agent.view(state.phase or phase).pinned
            built = assemble(pinned, history, state.input, state.transcript,
                             agent.context.excerpt_keep, recalled)  # fmt: skip
            requests.append({"system": built.system, "tools": pinned.tools,
                             "messages": built.messages})  # fmt: skip
        state = apply(state, data, version=event.version, turn_id=turn_id)
    return requests


def _request(data: object) -> bool:
    """A request assembled: a sent one's ``model.call`` (v1's, upcast), or one over its budget,
    never sent, recorded as a ``context.assembled`` of its own."""
    if isinstance(data, ModelCall):
        return data.context is not None
    return isinstance(data, ContextAssembled)


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


async def _fork_starts(store: EventStore, session: list[RecordedEvent]) -> dict[str, int]:
    """The ``turn.start`` positions of the turns a fork copied (turns of another session): the
    live history orders the copied rows by them, and a digest's ``through`` cuts them by them."""
    copied = sorted({t for e in session if isinstance(e.data, SessionForked) for t in e.data.turns})
    if not copied:
        return {}
    starts = await store.aread_turns(copied, [TurnStart.TYPE])
    return {e.metadata.turn_id: e.position for e in starts if e.metadata.turn_id is not None}


def _history_before(
    session: list[RecordedEvent], start: int, fork_starts: dict[str, int]
) -> History:
    """The history a turn accepted at log position ``start`` read (turns run one at a time, so
    every earlier turn that ran had ended): the rows a fork copied, if the session was forked
    (and not cleared since), then its own earlier turns' rows."""
    cleared = max((e.position for e in session if isinstance(e.data, SessionCleared)
                   and e.position < start), default=-1)  # fmt: skip
    entries = _forked(session, cleared, start, fork_starts)
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
        if isinstance(event.data, TurnAttempt) or (
            isinstance(event.data, TurnStart) and event.data.attempt
        ):
            ran.add(turn)
        elif isinstance(event.data, TurnEnd):
            ends[turn] = event.data
    earlier = sorted((s, t) for t, s in starts.items()
                     if cleared < s < start and t in ran and t in ends)  # fmt: skip
    history = History()
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
        rungs.replay(history, stage)
    if earlier:
        end = ends[earlier[-1][1]]
        error = end.error
        history.last_error = last_error_line(end.reason, error.code if error else None,
                                             error.message if error else None)  # fmt: skip
    return history


def _forked(
    session: list[RecordedEvent], cleared: int, start: int, fork_starts: dict[str, int]
) -> list[Entry]:
    """The entries of the session's ``session.forked`` (its first event), unless a clear after
    it dropped them; each row keeps its source turn and that turn's start, as the messages
    projection and the live history (load.py) have them."""
    for event in session:
        data = event.data
        if isinstance(data, SessionForked) and cleared < event.position < start:
            return [entry(m.turn_id, fork_starts.get(m.turn_id, event.position), m.role, m.content)
                    for m in data.messages]  # fmt: skip
    return []


def _notes_before(session: list[RecordedEvent], position: int) -> tuple[str, ...]:
    notes: tuple[str, ...] = ()
    for event in session:
        if event.position >= position:
            break
        notes = session_notes.evolve(notes, event.data)
    return notes


def _phase_before(session: list[RecordedEvent], position: int) -> str | None:
    phase: str | None = None
    for event in session:
        if event.position >= position:
            break
        phase = phases.evolve(phase, event.data)
    return phase
