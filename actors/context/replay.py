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
from typing import Any

from actors.agent import Agent
from actors.context.assemble import assemble
from actors.context.compact import digest_of
from actors.context.history import Entry, History, after_stage, entry
from actors.context.load import last_error_line
from actors.tools import notes as session_notes
from actors.turn.core import TurnState, apply
from eventstore import START, EventStore, RecordedEvent, streams
from eventstore.catalogue import (
    CompactionStage,
    ContextAssembled,
    ModelResult,
    SessionCleared,
    SessionNote,
    ToolResult,
    TurnAttempt,
    TurnEnd,
    TurnStart,
)
from eventstore.projections import history_row

_TYPES = [t.TYPE for t in (TurnStart, TurnAttempt, ModelResult, ToolResult, TurnEnd,
                           CompactionStage, SessionNote, SessionCleared)]  # fmt: skip
_PAGE = 1000


async def replay(store: EventStore, agent: Agent, turn_id: str) -> list[dict[str, Any]] | None:
    """Each model call of the turn as it was sent (``system``, ``tools``, ``messages``), in
    order; None if there is no such turn."""
    own = await store.aread_stream(streams.turn(turn_id))
    if not own or not isinstance(own[0].data, TurnStart):
        return None
    meta = own[0].metadata
    session = await _session_events(store, meta.agent_id or "", meta.session_key or "", own[-1])
    start = own[0].position
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
    store: EventStore, agent_id: str, session_key: str, last: RecordedEvent
) -> list[RecordedEvent]:
    """The session's events that shape a context, up to ``last`` (the turn's last event)."""
    found: list[RecordedEvent] = []
    after = START
    while True:
        page = await store.aread_scoped(after, _PAGE, agent_id=agent_id,
                                        session_key=session_key, types=_TYPES)  # fmt: skip
        found.extend(e for e in page if e.position <= last.position)
        if len(page) < _PAGE or page[-1].position >= last.position:
            return found
        after = page[-1].checkpoint


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
