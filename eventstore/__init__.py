"""The log: append, read and subscribe; the event catalogue and codec; projections.

This package imports nothing else of Dispach (DESIGN.md 3).
"""

from eventstore import catalogue, streams, subjects
from eventstore.decision import AppendResult
from eventstore.envelope import (
    START,
    Checkpoint,
    Metadata,
    NewEvent,
    RecordedEvent,
    WireEvent,
    encode_wire,
    to_wire,
)
from eventstore.errors import (
    DispachError,
    EventIdReused,
    Fenced,
    InvalidAppend,
    InvalidCursor,
    InvalidValue,
    MigrationError,
    StoreClosed,
    StoreError,
    StoreOverloaded,
    StoreUnavailable,
    WrongExpectedVersion,
)
from eventstore.event import REGISTRY, Event, UnknownEvent
from eventstore.fencing import Fence, FencingHook
from eventstore.hints import Hints, NatsHints
from eventstore.migrations import migrate
from eventstore.projections import ASYNC, INLINE
from eventstore.projections.sessions import SessionsProjection
from eventstore.projections.turns import TurnsProjection
from eventstore.projector import Projection, ProjectionRunner
from eventstore.rebuild import rebuild
from eventstore.store import EventStore
from eventstore.versions import ANY, NO_STREAM

__all__ = [
    "ANY",
    "ASYNC",
    "INLINE",
    "NO_STREAM",
    "REGISTRY",
    "START",
    "AppendResult",
    "Checkpoint",
    "DispachError",
    "Event",
    "EventIdReused",
    "EventStore",
    "Fence",
    "Fenced",
    "FencingHook",
    "Hints",
    "InvalidAppend",
    "InvalidCursor",
    "InvalidValue",
    "Metadata",
    "MigrationError",
    "NatsHints",
    "NewEvent",
    "Projection",
    "ProjectionRunner",
    "RecordedEvent",
    "SessionsProjection",
    "StoreClosed",
    "StoreError",
    "StoreOverloaded",
    "StoreUnavailable",
    "TurnsProjection",
    "UnknownEvent",
    "WireEvent",
    "WrongExpectedVersion",
    "catalogue",
    "encode_wire",
    "migrate",
    "rebuild",
    "streams",
    "subjects",
    "to_wire",
]
