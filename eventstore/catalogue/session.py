"""Schedules (stream ``schedule-<agentId>-<scheduleId>``), channels'
rejections (``channel-<agentId>-<channelId>``), and sessions: cleared, forked, notes, phases, the
skills a turn's recall picked."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

from eventstore.event import Event, register

# --- schedules (stream schedule-<agentId>-<scheduleId>) and sessions ---------------------------


class ScheduleDefined(Event, frozen=True):
    """A schedule was created or replaced (``spec`` is its whole definition, camelCase as the
    API takes it); ``owner`` is ``manifest`` or ``api``."""

    TYPE: ClassVar[str] = "schedule.defined"
    schedule_id: str
    spec: dict[str, Any]
    owner: Literal["manifest", "api"]


class ScheduleRemoved(Event, frozen=True):
    TYPE: ClassVar[str] = "schedule.removed"
    schedule_id: str


class ScheduleFired(Event, frozen=True):
    TYPE: ClassVar[str] = "schedule.fired"
    schedule_id: str
    kind: Literal["cron", "every", "at"]
    drift_ms: int
    late: bool = False
    due: str = ""
    turn_id: str | None = None
    session_key: str | None = None
    manual: bool = False


class ScheduleSkipped(Event, frozen=True):
    TYPE: ClassVar[str] = "schedule.skipped"
    schedule_id: str
    kind: Literal["cron", "every", "at"]
    reason: str
    missed: int
    missed_at_least: bool = False
    up_to: str = ""
    """The last skipped due time (ISO 8601): the scheduler goes on after it."""


# --- channels (stream channel-<agentId>-<channelId>) ---------------------------------------------


class ChannelRejected(Event, frozen=True):
    """An inbound channel message that did not become a turn: a duplicate (the provider sent the
    same update again), a sender not on the allow-list, or something the channel cannot take."""

    TYPE: ClassVar[str] = "channel.rejected"
    channel_id: str
    reason: Literal["duplicate", "denied", "unsupported", "refused"]
    message: str
    hint: str = ""
    update_id: str | None = None
    sender_id: str | None = None
    turn_id: str | None = None


class SessionCleared(Event, frozen=True):
    TYPE: ClassVar[str] = "session.cleared"
    by: str | None = None


class ForkedMessage(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One history row a fork copied, as the source session's messages projection held it: its
    turn and log position are the source's, so the new session reads its turns in their order
    and before any of its own."""

    turn_id: str
    position: int
    role: Literal["user", "assistant", "tool"]
    content: Any


class SessionForked(Event, frozen=True):
    """A session starts from another session's history, up to and including one of its turns
    (the first event of the new session's stream; the source session is not touched). The rows
    copied are the event's, so the new session's history is rebuilt from the log alone; they
    are the conversation, so they stay off public streams. Notes are not copied."""

    TYPE: ClassVar[str] = "session.forked"
    PRIVATE: ClassVar[frozenset[str]] = frozenset({"messages"})
    source_agent_id: str
    source_session_key: str
    at_turn_id: str
    turns: list[str] = msgspec.field(default_factory=list)
    """The turns whose rows were copied, in order (those the source had inherited from a fork
    of its own included)."""
    messages: list[ForkedMessage] = msgspec.field(default_factory=list)


class SessionNote(Event, frozen=True):
    """The session-notes tool wrote: ``append`` adds a note, ``replace`` sets all notes to
    ``text`` (an empty text clears them). Notes are the agent's, so they stay off public streams."""

    TYPE: ClassVar[str] = "session.note"
    PRIVATE: ClassVar[frozenset[str]] = frozenset({"text"})
    action: Literal["append", "replace"]
    text: str | None = None
    turn_id: str | None = None


class PhaseChanged(Event, frozen=True):
    """The session moved to another phase (its manifest's ``phases``), so the tools its model
    sees changed: by the ``phase_set`` tool inside a turn (in the turn's stream: the turn's next
    step sees the new phase's tools) or by ``POST …/sessions/{key}/phase`` (in the session's
    stream: its next turn does). ``from`` is the phase it left (null when a session without a
    row yet has none to name); ``tools`` how many tools the new phase shows the model."""

    TYPE: ClassVar[str] = "phase.changed"
    to: str
    from_: str | None = msgspec.field(default=None, name="from")
    by: Literal["tool", "api"] = "tool"
    tools: int = 0


class Picked(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """One skill or note a turn's recall chose: a skill by id and version, a note by number."""

    id: str
    rank: float = 0.0
    """Its full-text rank against the turn's words (``ts_rank_cd``)."""
    tokens: int = 0
    digest: str | None = None


class SkillSelected(Event, frozen=True):
    """What the turn's recall put before the model, chosen once before its first model call
    (a resumed turn reads it back, never selects again): skills by rank, notes (``memory``,
    numbered from 1 as ``session_notes`` lists them) by rank, ``tokens`` the block's size."""

    TYPE: ClassVar[str] = "skill.selected"
    skills: list[Picked] = msgspec.field(default_factory=list)
    memory: list[Picked] = msgspec.field(default_factory=list)
    tokens: int = 0


class SkillNone(Event, frozen=True):
    """The turn's recall found nothing relevant among ``candidates`` skills and ``notes``."""

    TYPE: ClassVar[str] = "skill.none"
    candidates: int = 0
    notes: int = 0


register(
    ScheduleDefined,
    ScheduleRemoved,
    ScheduleFired,
    ScheduleSkipped,
    ChannelRejected,
    SessionCleared,
    SessionForked,
    SessionNote,
    PhaseChanged,
    SkillSelected,
    SkillNone,
)
