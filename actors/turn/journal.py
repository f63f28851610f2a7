"""A turn's events on their way to its stream: each folded into the turn's state as it is
staged, staged events sent together, and only what an effect waits on awaited.

The runner is the stream's only writer, so each append can expect the version the one before it
will leave: appends to one stream are committed in the order they were submitted (the writer
never puts two of a stream's appends in one batch). What must be durable before an effect
(``tool.call`` before a mutating tool runs, ``turn.end`` before the turn counts as over) is
awaited with :meth:`Journal.append`; a model call does not wait for its ``model.call``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import msgspec

from actors.turn.core import TurnState, apply, fold
from eventstore import AppendResult, EventStore, Metadata, NewEvent, RecordedEvent, StoreError
from eventstore.bridge import settled
from eventstore.event import Event
from eventstore.projections.sessions import history_row


class Journal:
    def __init__(self, store: EventStore, stream: str, meta: Metadata) -> None:
        self.store = store
        self.stream = stream
        self.meta = meta
        """What every event's metadata starts from (its trace context, once the run has one)."""
        self.step_id: str | None = None
        """The step the events staged now belong to."""
        self.state = TurnState()
        self.rows: list[tuple[str, Any]] = []
        """The history rows (role, content) of the events staged since :meth:`read`."""
        self._staged: list[tuple[Event, str | None]] = []
        self._sent_version = -1
        self._in_flight: list[Future[AppendResult]] = []

    def read(self, stored: Sequence[RecordedEvent]) -> TurnState:
        """Start from the turn's stored events (a run, or a run again after the store failed):
        whatever was staged or in flight before is forgotten."""
        self.state = fold(list(stored))
        self.rows, self._staged, self._in_flight = [], [], []
        self._sent_version = self.state.version
        return self.state

    def stage(self, events: Sequence[Event]) -> None:
        """Fold events into the state now and append them with the next append: facts that no
        side effect waits on share a commit with what follows them."""
        for event in events:
            self.state = apply(self.state, event, version=self.state.version + 1)
            self._staged.append((event, self.step_id))
            row = history_row(event)
            if row is not None:
                self.rows.append(row)

    def send(self, events: Sequence[Event] = ()) -> None:
        """Submit the staged events and ``events`` as one append without waiting for it; a store
        that refuses to take it (closed, overloaded) raises, and the events stay staged."""
        self.stage(events)
        staged = self._staged
        if not staged:
            return
        base = self.meta
        future = self.store.submit(
            self.stream,
            [NewEvent(event=e, metadata=msgspec.structs.replace(base, step_id=step))
             for e, step in staged],
            self._sent_version,
        )  # fmt: skip
        self._staged = []
        self._sent_version += len(staged)
        self._in_flight.append(future)

    def send_soon(self) -> None:
        """:meth:`send`, from a timer: a store that refuses it now is told to the turn by its
        next append, which carries the same events."""
        with contextlib.suppress(StoreError):
            self.send()

    async def append(self, events: Sequence[Event] = ()) -> None:
        """Submit (as :meth:`send`) and wait until everything sent so far is committed.

        Only the last append is waited on: each expects the version the one before it leaves,
        so it commits only if they all did. Waiting on each in turn cost a callback per append,
        all in one run of the loop once they were answered (a 2,000-chunk reply: 0.5 s with
        nothing else served). When the last one failed, the first failure is the one raised."""
        self.send(events)
        in_flight, self._in_flight = self._in_flight, []
        if not in_flight:
            return
        try:
            await settled(in_flight[-1])
        except Exception:
            for future in in_flight[:-1]:
                await settled(future)  # raises the earliest failure, if an earlier one failed
            raise
