"""Session notes: the agent's own scratchpad for a session, kept as events in its session stream.

:func:`evolve` is the pure fold from events to notes; :class:`StoreNotes` is the thin shell that
reads and appends them on the real store.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from eventstore import ANY, Event, EventStore, Metadata, NewEvent, UnknownEvent, streams
from eventstore.catalogue import SessionCleared, SessionNote

_PAGE = 1000


class Notes(Protocol):
    """The notes of one session, as a tool sees them."""

    async def read(self) -> list[str]: ...

    async def append(self, text: str) -> None: ...

    async def replace(self, text: str) -> None:
        """Set the notes to ``text`` alone; an empty ``text`` clears them."""
        ...


def evolve(notes: tuple[str, ...], event: Event | UnknownEvent) -> tuple[str, ...]:
    """The notes after ``event``; events that are not about notes leave them as they are."""
    match event:
        case SessionNote(action="append", text=str(text)) if text:
            return (*notes, text)
        case SessionNote(action="replace", text=str(text)) if text:
            return (text,)
        case SessionNote(action="replace") | SessionCleared():
            return ()
        case _:
            return notes


def replay(events: Iterable[Event | UnknownEvent]) -> list[str]:
    notes: tuple[str, ...] = ()
    for event in events:
        notes = evolve(notes, event)
    return list(notes)


class StoreNotes:
    """:class:`Notes` of one session on the event store, written on behalf of one turn."""

    def __init__(self, store: EventStore, agent_id: str, session_key: str, turn_id: str) -> None:
        self._store = store
        self._stream = streams.session(agent_id, session_key)
        self._turn_id = turn_id
        self._metadata = Metadata(agent_id=agent_id, session_key=session_key, turn_id=turn_id)
        self.written = False
        """Whether a note was written through this object (the session's notes changed)."""

    async def read(self) -> list[str]:
        notes: tuple[str, ...] = ()
        version = 0
        while True:
            page = await self._store.aread_stream(self._stream, version, _PAGE)
            for recorded in page:
                notes = evolve(notes, recorded.data)
            if len(page) < _PAGE:
                return list(notes)
            version = page[-1].version + 1

    async def append(self, text: str) -> None:
        await self._write(SessionNote(action="append", text=text, turn_id=self._turn_id))

    async def replace(self, text: str) -> None:
        await self._write(SessionNote(action="replace", text=text, turn_id=self._turn_id))

    async def _write(self, note: SessionNote) -> None:
        self.written = True
        # ANY: a note does not depend on the session's state, and the session actor (the stream's
        # writer) must not be refused because a tool wrote in between.
        await self._store.aappend(
            self._stream, [NewEvent(event=note, metadata=self._metadata)], expected_version=ANY
        )
