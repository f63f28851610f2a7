"""Deciding one append against the stored state: a pure function, so it is tested by table."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec

from eventstore.envelope import Checkpoint, NewEvent, RecordedEvent
from eventstore.errors import EventIdReused, Fenced, StoreError, WrongExpectedVersion
from eventstore.event import type_name
from eventstore.fencing import Fence
from eventstore.versions import ANY, NO_STREAM


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
    fence: Fence | None = None
    """The partition and lease epoch it is appended under; None when it is not fenced."""
    on_loop: bool = False
    """Submitted on the store's event loop: answered there, with the rest of its batch in one
    hand-over (see GroupCommitWriter.deliver_on); otherwise answered in the writer's thread."""


def decide(
    command: Command,
    head: int,
    existing: dict[uuid.UUID, RecordedEvent],
    fence_epoch: int | None = None,
) -> int | AppendResult | StoreError:
    """The version to append after, the original events of a retried append, or the error.

    ``fence_epoch`` is the current fence of the command's partition (None: it has none). A retry
    of stored events is answered with them even under a stale epoch: they were committed while
    the epoch was current, and answering them writes nothing. A stale epoch is told before a
    stale version: the caller must go to the new owner, not reload and retry here.
    """
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
    fence = command.fence
    if fence is not None and fence_epoch is not None and fence_epoch > fence.epoch:
        return Fenced(command.stream, fence.partition, fence.epoch, fence_epoch)
    if command.expected not in (ANY, head):
        return WrongExpectedVersion(command.stream, command.expected, head)
    return head


# --- batching: which commands a batch may carry together -----------------------------------


def carry_of(carry: list[Command], stream: str) -> bool:
    """Whether a command of ``stream`` already waits: later ones must not overtake it."""
    return any(c.stream == stream for c in carry)


def continues(first: Command, then: Command) -> bool:
    """``then`` expects exactly the version ``first`` leaves (both explicit, not ANY), under the
    same fence: a chain is decided as one command, so it has one fence to be checked against."""
    return (
        first.expected >= NO_STREAM
        and then.expected == first.expected + len(first.events)
        and first.fence == then.fence
    )


def fenced_partitions(commands: Sequence[Command]) -> list[int]:
    """The partitions the fenced commands append to, whose fence rows the append statement
    locks (sql/append.sql) and the explanation reads."""
    return sorted({c.fence.partition for c in commands if c.fence is not None})


def chain(first: Command, then: Command) -> Command:
    """One command carrying both: all or nothing, like either alone (``then`` could not commit
    without ``first``: it expects the version ``first`` leaves). Each caller gets its own part
    of the result, or the same error. Only commands under equal fences chain (see continues)."""
    if first.fence != then.fence:
        raise ValueError(
            f"cannot chain appends under different fences: {first.fence}, {then.fence}"
        )
    links = [*(first.links or [first]), then]
    merged = Command(
        first.stream, [*first.events, *then.events], first.expected, links=links,
        fence=first.fence, on_loop=all(link.on_loop for link in links),
    )  # fmt: skip

    def settle(done: Future[AppendResult]) -> None:
        error = done.exception()
        start = 0
        for link in links:
            end = start + len(link.events)
            if not link.future.done():  # done: the caller gave up waiting (cancelled)
                if error is not None:
                    link.future.set_exception(error)
                else:
                    result = done.result()
                    part = result.events[start:end]
                    link.future.set_result(AppendResult(result.stream, part, result.duplicate))
            start = end

    merged.future.add_done_callback(settle)
    return merged
