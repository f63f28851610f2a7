"""Commands between the edges and the actors, and their replies (msgspec, JSON on NATS)."""

from __future__ import annotations

from typing import Literal

import msgspec

from actors.schedule.plan import ScheduleSpec
from eventstore.catalogue import Deliver, Sender

Policy = Literal["queue", "reject", "interrupt"]


class Submit(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A message for an agent's session: accepted as a turn, or refused."""

    agent_id: str
    session_key: str
    text: str
    source: str = "api"
    deliver: Deliver | None = None
    concurrency: Policy | None = None
    idempotency_key: str | None = None
    sender: Sender | None = None
    turn_id: str | None = None
    """Set by the engine for a keyed message (derived from the key); otherwise minted."""
    request_hash: str | None = None
    """Set by the engine for a keyed message."""


class Accepted(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    turn_id: str
    session_key: str
    replayed: bool = False
    """True when an ``Idempotency-Key`` named a turn accepted before: nothing new runs."""


class ClearSession(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """Drop a session's history from the next turns' context (appends ``session.cleared``)."""

    agent_id: str
    session_key: str
    by: str = "api"


class Cleared(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    session_key: str


class Refused(msgspec.Struct, frozen=True, kw_only=True):
    code: str
    message: str
    hint: str
    field: str | None = None


class StopTurn(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    turn_id: str
    by: str = "api"


class StopResult(msgspec.Struct, frozen=True, kw_only=True):
    stopping: bool
    """True when the turn was running or queued and is now stopping."""
    state: str
    """``stopping``, ``stopped`` (was queued), ``ended`` (already over) or ``unknown``."""


class Resume(msgspec.Struct, frozen=True):
    turn_ids: list[str]


class TurnFinished(msgspec.Struct, frozen=True):
    turn_id: str
    reason: str | None


class ResolveApproval(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A person's answer to a tool call that asked for approval (or its timeout)."""

    agent_id: str
    approval_id: str
    granted: bool
    by: str = "api"
    turn_id: str | None = None
    """Filled in by the engine (from the approvals projection) for the session actor."""


class Resolved(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    approval_id: str
    granted: bool


class Reply(msgspec.Struct, frozen=True, omit_defaults=True):
    """The envelope of an answer on NATS: exactly one of the fields is set."""

    accepted: Accepted | None = None
    stop: StopResult | None = None
    cleared: Cleared | None = None
    resolved: Resolved | None = None
    error: Refused | None = None


class DefineSchedule(msgspec.Struct, frozen=True, kw_only=True):
    """Create (``expected`` = NO_STREAM) or replace a schedule; answered with a future of the
    append (see actors/schedule/actor.py)."""

    agent_id: str
    spec: ScheduleSpec
    owner: Literal["manifest", "api"]
    expected: int


class RemoveSchedule(msgspec.Struct, frozen=True, kw_only=True):
    agent_id: str
    schedule_id: str
    expected: int


class RunSchedule(msgspec.Struct, frozen=True, kw_only=True):
    """Fire a schedule now, out of band; answered with a future of Accepted | Refused."""

    agent_id: str
    schedule_id: str
