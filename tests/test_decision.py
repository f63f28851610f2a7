"""The append decision, table-driven: it is a pure function of the command and stored state."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from eventstore import (
    ANY,
    NO_STREAM,
    EventIdReused,
    Fence,
    Fenced,
    Metadata,
    NewEvent,
    RecordedEvent,
)
from eventstore.catalogue import ModelChunk, TurnStart
from eventstore.decision import AppendResult, Command, decide
from eventstore.errors import WrongExpectedVersion

A, B = NewEvent(event=ModelChunk(delta="a")), NewEvent(event=ModelChunk(delta="b"))


def stored(new: NewEvent, stream: str, version: int) -> RecordedEvent:
    return RecordedEvent(
        stream, version, 100 + version, 7, new.event_id, new.event.TYPE, new.event, Metadata(),
        datetime.now(UTC),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("expected", "head", "outcome"),
    [
        (NO_STREAM, -1, -1),  # a new stream starts at version 0
        (ANY, -1, -1),
        (ANY, 4, 4),  # append at whatever the head is
        (4, 4, 4),  # the expected head
        (NO_STREAM, 0, WrongExpectedVersion),  # the stream exists already
        (3, 4, WrongExpectedVersion),  # another writer appended
        (5, 4, WrongExpectedVersion),  # ahead of the stream: would leave a gap
    ],
)
def test_versions(expected: int, head: int, outcome: int | type) -> None:
    decided = decide(Command("turn-x", [A], expected), head, {})
    if isinstance(outcome, int):
        assert decided == outcome
    else:
        assert isinstance(decided, outcome)


def test_a_retry_of_stored_events_returns_them_whatever_the_version() -> None:
    existing = {A.event_id: stored(A, "turn-x", 0), B.event_id: stored(B, "turn-x", 1)}
    decided = decide(Command("turn-x", [A, B], NO_STREAM), 1, existing)
    assert isinstance(decided, AppendResult)
    assert decided.duplicate
    assert [e.version for e in decided.events] == [0, 1]


@pytest.mark.parametrize(
    ("command", "existing"),
    [
        (Command("turn-x", [A, B], ANY), {A.event_id: stored(A, "turn-x", 0)}),  # partly stored
        (Command("turn-y", [A], ANY), {A.event_id: stored(A, "turn-x", 0)}),  # other stream
        (
            Command("turn-x", [NewEvent(event=TurnStart(source="api"), event_id=A.event_id)], ANY),
            {A.event_id: stored(A, "turn-x", 0)},  # same id, another type
        ),
        (
            Command("turn-x", [A, B], ANY),
            {A.event_id: stored(A, "turn-x", 1), B.event_id: stored(B, "turn-x", 0)},
        ),  # stored in another order
    ],
)
def test_a_reused_event_id_is_refused(
    command: Command, existing: dict[uuid.UUID, RecordedEvent]
) -> None:
    assert isinstance(decide(command, 5, existing), EventIdReused)


@pytest.mark.parametrize(
    ("fence", "current", "expected", "outcome"),
    [
        (None, None, ANY, 4),  # unfenced, no fence row
        (None, 9, ANY, 4),  # unfenced commands ignore fences
        (Fence(3, 5), None, ANY, 4),  # the partition has no fence row yet: nothing refuses
        (Fence(3, 5), 5, ANY, 4),  # the current epoch
        (Fence(3, 6), 5, ANY, 4),  # newer than the fence (raised after this read)
        (Fence(3, 5), 6, ANY, Fenced),  # the partition moved on
        (Fence(3, 5), 6, 1, Fenced),  # a stale epoch is told before a stale version
        (Fence(3, 5), 5, 1, WrongExpectedVersion),
    ],
)
def test_fences(
    fence: Fence | None, current: int | None, expected: int, outcome: int | type
) -> None:
    decided = decide(Command("turn-x", [A], expected, fence=fence), 4, {}, current)
    if isinstance(outcome, int):
        assert decided == outcome
    else:
        assert isinstance(decided, outcome)


def test_a_fenced_command_names_the_partition_and_both_epochs() -> None:
    decided = decide(Command("turn-x", [A], ANY, fence=Fence(3, 5)), 4, {}, 8)
    assert isinstance(decided, Fenced)
    assert (decided.code, decided.partition, decided.epoch, decided.current) == (
        "session_moving", 3, 5, 8
    )  # fmt: skip
    assert "partition 3" in decided.message and "epoch 5" in decided.message
    assert "epoch 8" in decided.message
    assert "new owner" in decided.hint


def test_a_retry_of_stored_events_under_a_stale_epoch_returns_them() -> None:
    # They were stored while the epoch was current; answering them writes nothing.
    existing = {A.event_id: stored(A, "turn-x", 0)}
    decided = decide(Command("turn-x", [A], NO_STREAM, fence=Fence(3, 5)), 0, existing, 6)
    assert isinstance(decided, AppendResult)
    assert decided.duplicate
    assert [e.event_id for e in decided.events] == [A.event_id]
