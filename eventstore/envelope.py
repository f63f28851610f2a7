"""What an appended event looks like on the way in, on the way out, and on the wire."""

from __future__ import annotations

import base64
import random
import struct
import uuid
from datetime import datetime

import msgspec

from eventstore.errors import InvalidCursor
from eventstore.event import Event, UnknownEvent, public_data


class Metadata(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, rename="camel"):
    """Who an event is about and what caused it; stored in ``events.metadata``."""

    agent_id: str | None = None
    session_key: str | None = None
    turn_id: str | None = None
    step_id: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None


EMPTY_METADATA = Metadata()


_ids = random.Random()  # noqa: S311 - ids must be unique, not secret


def new_event_id() -> uuid.UUID:
    """A random (version 4) UUID without a system call: event ids must be unique, not
    unguessable, and ``uuid4`` reads the OS's entropy pool for every id (measured at about
    0.3 ms of a turn's event-loop time under load, with the GIL hand-offs of the syscall)."""
    return uuid.UUID(int=_ids.getrandbits(128), version=4)


class NewEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event to append. Give ``event_id`` deterministically to make a retried append a no-op."""

    event: Event
    metadata: Metadata = EMPTY_METADATA
    event_id: uuid.UUID = msgspec.field(default_factory=new_event_id)


class Checkpoint(msgspec.Struct, frozen=True, order=True):
    """A position in the global log: ``(transaction_id, global_position)``.

    Events are read in this order and only below the oldest running transaction, so a reader that
    resumes after a checkpoint never skips an event that committed later with a smaller position.
    """

    txid: int = 0
    position: int = 0

    def cursor(self) -> str:
        """An opaque, URL-safe token for this checkpoint."""
        raw = struct.pack(">QQ", self.txid, self.position)
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    @classmethod
    def from_cursor(cls, cursor: str) -> Checkpoint:
        try:
            raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
            txid, position = struct.unpack(">QQ", raw)
        except (ValueError, struct.error) as e:
            raise InvalidCursor(cursor) from e
        # global_position is a bigint: a larger position is past every event, as is the largest.
        return cls(txid, min(position, 2**63 - 1))


START = Checkpoint()


class RecordedEvent(msgspec.Struct, frozen=True, gc=False):
    """An event as stored: its stream, version, global order and metadata."""

    stream: str
    version: int
    position: int
    txid: int
    event_id: uuid.UUID
    type: str
    data: Event | UnknownEvent
    metadata: Metadata
    recorded_at: datetime

    @property
    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.txid, self.position)

    @property
    def category(self) -> str:
        return self.stream.split("-", 1)[0]


class WireEvent(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, rename="camel"):
    """The public envelope (Dispach v1's, plus ``id``, ``cursor`` and ``position``)."""

    v: int
    id: str
    cursor: str
    position: int
    ts: str
    runtime_id: str | None = None
    """v1's ``runtimeId``: here the id of the node that serves the stream (any node serves any
    event, whoever wrote it), so a reader can tell which node it is attached to."""
    type: str
    data: msgspec.Raw
    agent_id: str | None = None
    session_key: str | None = None
    turn_id: str | None = None
    step_id: str | None = None
    stream: str | None = None


_WIRE = msgspec.json.Encoder()


def to_wire(
    recorded: RecordedEvent, runtime_id: str | None = None, *, reveal: bool = False
) -> WireEvent:
    """The public envelope of ``recorded``, as served by the node ``runtime_id`` (``reveal``:
    with its revealable private fields, for an operator's read of stored events only; the
    streams go through :func:`encode_wire`, which never reveals)."""
    meta = recorded.metadata
    return WireEvent(
        v=1,
        id=str(recorded.event_id),
        cursor=recorded.checkpoint.cursor(),
        position=recorded.position,
        ts=recorded.recorded_at.isoformat().replace("+00:00", "Z"),
        runtime_id=runtime_id,
        type=recorded.type,
        data=msgspec.Raw(public_data(recorded.data, reveal=reveal)),
        agent_id=meta.agent_id,
        session_key=meta.session_key,
        turn_id=meta.turn_id,
        step_id=meta.step_id,
        stream=recorded.stream,
    )


def encode_wire(recorded: RecordedEvent, runtime_id: str | None = None) -> bytes:
    """The JSON of the public envelope: tool arguments and outputs are never in it."""
    return _WIRE.encode(to_wire(recorded, runtime_id))
