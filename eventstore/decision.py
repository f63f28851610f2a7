"""Deciding one append against the stored state: a pure function, so it is tested by table."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec

from eventstore.envelope import Checkpoint, NewEvent, RecordedEvent
from eventstore.errors import EventIdReused, StoreError, WrongExpectedVersion
from eventstore.event import type_name
from eventstore.versions import ANY


class AppendResult(msgspec.Struct, frozen=True):
    """The stored events of one append; ``duplicate`` when they had been stored before."""

    stream: str
    events: list[RecordedEvent]
    duplicate: bool = False

    @property
    def version(self) -> int:
        """The stream's version after this append (its last event's version)."""
        return self.events[-1].version

    @property
    def checkpoint(self) -> Checkpoint:
        return self.events[-1].checkpoint


@dataclass(eq=False)
class Command:
    stream: str
    events: Sequence[NewEvent]
    expected: int
    future: Future[AppendResult] = field(default_factory=Future)
    links: list[Command] | None = None
    """The callers' commands this one chains (see writer.chain); None for a caller's own."""


def decide(
    command: Command, head: int, existing: dict[uuid.UUID, RecordedEvent]
) -> int | AppendResult | StoreError:
    """The version to append after, the original events of a retried append, or the error."""
    found = [existing.get(e.event_id) for e in command.events]
    if any(f is not None for f in found):
        for new, old in zip(command.events, found, strict=True):
            if old is None:
                return EventIdReused(command.stream, str(new.event_id), "only part of the batch")
            if old.stream != command.stream or old.type != type_name(new.event):
                return EventIdReused(
                    command.stream, str(new.event_id), f"as {old.type} in {old.stream}"
                )
        versions = [f.version for f in found if f is not None]
        if versions != list(range(versions[0], versions[0] + len(versions))):
            return EventIdReused(command.stream, str(command.events[0].event_id), "out of order")
        return AppendResult(command.stream, [f for f in found if f is not None], duplicate=True)
    if command.expected not in (ANY, head):
        return WrongExpectedVersion(command.stream, command.expected, head)
    return head
