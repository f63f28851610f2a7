"""An agent's lifecycle as the log holds it (stream ``agent-<id>``): whether it takes messages,
since when and by whom, and the version of its manifest last reloaded. Pure: the fold of the
stream's events, what a stop, start or reload appends, and the refusal every door gives a
message for a stopped agent. The node's side (reading manifests, swapping agents, telling the
other nodes) is runtime/lifecycle.py."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

import msgspec

from actors.messages import Refused
from eventstore import RecordedEvent
from eventstore.catalogue import AgentReloaded, AgentStarted, AgentStopped

STOPPED = "agent_stopped"
"""The refusal of a message for a stopped agent (409 on HTTP)."""


class Life(msgspec.Struct, frozen=True, kw_only=True):
    """The fold of one agent's stream."""

    agent_id: str
    stream_version: int = -1
    """The last version folded (-1: the stream is empty)."""
    disabled: bool = False
    disabled_at: datetime | None = None
    disabled_by: str | None = None
    reason: str | None = None
    reloaded: AgentReloaded | None = None
    """The last reload on the record (its manifest is the text every node runs since)."""
    reloaded_at: datetime | None = None
    reloaded_position: int = -1
    """The stream version of that reload: a node builds each reload once."""

    @property
    def status(self) -> str:
        """v1's words: ``loaded`` or ``disabled``."""
        return "disabled" if self.disabled else "loaded"


def evolve(life: Life, event: RecordedEvent) -> Life:
    replace = msgspec.structs.replace
    life = replace(life, stream_version=event.version)
    match event.data:
        case AgentStopped(by=by, reason=reason):
            return replace(life, disabled=True, disabled_at=event.recorded_at, disabled_by=by,
                           reason=reason)  # fmt: skip
        case AgentStarted():
            return replace(life, disabled=False, disabled_at=None, disabled_by=None, reason=None)
        case AgentReloaded() as reloaded:
            return replace(life, reloaded=reloaded, reloaded_at=event.recorded_at,
                           reloaded_position=event.version)  # fmt: skip
    return life


def fold(life: Life, events: Iterable[RecordedEvent]) -> Life:
    for event in events:
        if event.version > life.stream_version:
            life = evolve(life, event)
    return life


def text_of(events: Iterable[object], version: str) -> str | None:
    """The manifest text of ``version`` as an agent's stream records it: a reload's own, or the
    one a reload replaced (the newest record wins); None when it holds none."""
    found: str | None = None
    for event in events:
        if isinstance(event, AgentReloaded):
            if event.version == version and event.manifest:
                found = event.manifest
            elif event.previous == version and event.previous_manifest:
                found = event.previous_manifest
    return found


def stop(life: Life, by: str, reason: str | None, node: str) -> list[AgentStopped]:
    """What a stop appends: nothing when the agent is stopped already (a stop is idempotent;
    the first one's time, caller and reason stand)."""
    return [] if life.disabled else [AgentStopped(by=by, reason=reason, node=node)]


def start(life: Life, by: str, node: str) -> list[AgentStarted]:
    """What a start appends: nothing when the agent takes messages already."""
    return [AgentStarted(by=by, node=node)] if life.disabled else []


def refusal(life: Life | None) -> Refused | None:
    """The answer to a new message for the agent, when it is stopped; None otherwise."""
    if life is None or not life.disabled:
        return None
    when = f" at {life.disabled_at.isoformat()}" if life.disabled_at is not None else ""
    why = f" ({life.reason})" if life.reason else ""
    return Refused(
        code=STOPPED,
        message=f"agent {life.agent_id!r} is disabled: stopped by {life.disabled_by or 'api'}"
        f"{when}{why}; it takes no new messages",
        hint=f"start it again: POST /v1/agents/{life.agent_id}/start (or `dispach agents "
        f"start {life.agent_id}`); turns accepted before the stop run to their end",
    )
