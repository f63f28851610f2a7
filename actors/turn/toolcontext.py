"""What a tool sees of its turn: the ``ToolContext`` port of actors/tools, backed by the log."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from actors.context import load as context_load
from actors.tools.notes import StoreNotes
from actors.tools.spec import PhaseSwitch
from eventstore import EventStore
from eventstore.catalogue import Budget
from eventstore.event import Event

Record = Callable[[Sequence[Event]], Awaitable[None]]


class ToolCallContext:
    """The turn a call belongs to, the session's notes and its tool results' whole bodies; for
    the engine's own tools (``handoff``), a way to put facts on the turn's record and what is
    left of the turn's budget."""

    def __init__(self, agent_id: str, session_key: str, turn_id: str, call_id: str,
                 notes: StoreNotes, artifacts: StoreArtifacts,
                 phases: PhaseSwitch | None = None, *, record: Record | None = None,
                 remaining: Budget | None = None,
                 stopping: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
        self.agent_id = agent_id
        self.session_key = session_key
        self.turn_id = turn_id
        self.call_id = call_id
        self.notes = notes
        self.artifacts = artifacts
        self.phases = phases
        self.record = record
        """Append events to the turn's stream, through its journal (the stream's one writer),
        and wait until they are committed."""
        self.remaining = remaining
        """The turn's budget left when the call started."""
        self.stopping = stopping
        """Whether a stop of the turn was asked for (a cancellation without one is the node
        draining: the turn resumes later)."""


class StoreArtifacts:
    """The whole bodies of a session's tool results, read from the log (``artifact_read``)."""

    def __init__(self, store: EventStore, agent_id: str, session_key: str) -> None:
        self._store, self._agent_id, self._session_key = store, agent_id, session_key

    async def read(self, obs_id: str) -> str | None:
        return await context_load.artifact(self._store, self._agent_id, self._session_key, obs_id)
