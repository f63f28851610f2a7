"""The fields of an agent manifest (``agents/<id>.yaml``) as msgspec Structs, and the default
agent's. The model's fields are :mod:`gateways.model.config`'s, the tool sources' are
:mod:`gateways.toolsources`'s; reading and building one is :mod:`runtime.manifest`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from actors.context.rungs import RUNGS
from actors.schedule.plan import ScheduleSpec
from gateways.channels import ChannelConfig
from gateways.manifests import Positive, Seconds
from gateways.model.config import ModelConfig
from gateways.toolsources import Declarations

_ID = r"^[a-z0-9][a-z0-9_-]{0,62}$"


class Instruction(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    text: str
    label: str = "instructions"


class ToolConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    module: str | None = None
    """``package.module:function`` for a tool of your own."""
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    mutating: bool = False
    timeout_s: Seconds | None = None
    policy: Literal["allow", "deny", "ask"] = "allow"
    """``ask``: each call waits for a person's approval (POST …/approvals/{id}); ``deny``: the
    model is told the call was refused."""
    untrusted_output: bool = False
    """What the tool returns comes from outside (a web page, a mail)."""
    tags: list[str] = msgspec.field(default_factory=list)
    """What a phase's ``allow`` matches as ``tag:<t>``."""


class PhaseConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One phase: the tools its model sees (names, ``tag:<t>``, or ``*``)."""

    allow: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(min_length=1)]
    entry: bool = False
    """Sessions start here (else in the first phase declared)."""


class LimitsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_steps: Positive = 8
    turn_timeout_s: Seconds = 300.0
    tool_timeout_s: Seconds = 30.0
    max_output_tokens: Positive = 32_000
    max_tool_output_chars: Positive = 16_000
    approval_timeout_s: Seconds = 3600.0
    untrusted_on_mutate: Literal["ask", "deny", "allow"] = "ask"
    daily_cost_usd: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """New turns are refused (``budget_exhausted``) once the agent's calls of the current UTC
    day cost this much, by the price table."""
    daily_tokens: Positive | None = None
    """New turns are refused once the agent's calls of the current UTC day read and wrote
    this many tokens (prompt, cache included, plus output)."""


Fraction = Annotated[float, msgspec.Meta(gt=0, lt=1)]


if TYPE_CHECKING:  # its fields are the rungs' names, known when the registry is: read generically

    class ThresholdsConfig(msgspec.Struct, frozen=True, kw_only=True):
        pass

else:
    ThresholdsConfig = msgspec.defstruct(
        "ThresholdsConfig",
        [(rung.name, Fraction, rung.threshold) for rung in RUNGS],
        module=__name__, frozen=True, kw_only=True, forbid_unknown_fields=True,
    )  # fmt: skip
    ThresholdsConfig.__doc__ = (
        "Fractions of the prompt budget (window less output reserve) at which each compaction "
        "rung starts, one field per rung of actors/context/rungs.py RUNGS (its default that "
        "rung's threshold); strictly ascending in that order."
    )


class ContextConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    thresholds: ThresholdsConfig = ThresholdsConfig()
    excerpt_over_tokens: Positive = 1000
    excerpt_keep_tokens: Positive = 300
    keep_turns: Annotated[int, msgspec.Meta(ge=0, le=100)] = 2
    compactor: ModelConfig | None = None
    """The model that writes digests; without one (or when it fails) digests are mechanical."""
    count_tokens: bool = False
    requests_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.3
    """The share of the prompt budget the verbatim list of earlier requests may take."""


class SkillsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The agent's skills: markdown files under ``dir`` (relative to the manifest's directory;
    by default ``<id>/skills`` beside ``<id>.yaml``), selected per turn by relevance."""

    dir: str | None = None
    max: Annotated[int, msgspec.Meta(ge=0, le=20)] = 1
    """Skills a turn may select (0: none are selected; pinned ones still apply)."""
    max_tokens: Positive = 2000
    """Tokens a skills block may take: each turn's selected one, and the pinned one."""
    pinned: list[str] = msgspec.field(default_factory=list)
    """Skill ids always in the context (a pinned block of the cached prefix), never selected."""


class RecallConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max: Annotated[int, msgspec.Meta(ge=1, le=50)] = 5
    """Notes a turn may recall."""
    max_tokens: Positive = 1000
    """Tokens the recalled notes' block may take."""


class MemoryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    recall: bool | RecallConfig = False
    """On (``true`` or its bounds): each turn sees only the session's notes that bear on its
    input and the previous reply, instead of every note."""


class SessionConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    concurrency: Literal["queue", "reject", "interrupt"] = "queue"


class MemberConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A member of a supervisor's team: an agent it may hand tasks to (runtime/teams.py)."""

    description: str
    """What the member is for: the supervisor's model reads it in the handoff tool."""
    artifact: dict[str, Any]
    """The JSON Schema (draft 2020-12) the member's final reply must satisfy."""


class Manifest(Declarations, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An agent, as its manifest declares it (the tool sources' fields come from
    :class:`~gateways.toolsources.Declarations`)."""

    id: Annotated[str, msgspec.Meta(pattern=_ID)]
    name: str | None = None
    model: ModelConfig = ModelConfig()
    instructions: list[str | Instruction] = msgspec.field(default_factory=list)
    reminders: list[str] = msgspec.field(default_factory=list)
    """Rules re-asserted in a pinned block after the instructions and configuration."""
    tools: list[str | ToolConfig] = msgspec.field(default_factory=list)
    limits: LimitsConfig = LimitsConfig()
    context: ContextConfig = ContextConfig()
    session: SessionConfig = SessionConfig()
    skills: SkillsConfig = SkillsConfig()
    memory: MemoryConfig = MemoryConfig()
    channels: list[ChannelConfig] = msgspec.field(default_factory=list)
    schedules: list[ScheduleSpec] = msgspec.field(default_factory=list)
    phases: dict[Annotated[str, msgspec.Meta(pattern=_ID)], PhaseConfig] = msgspec.field(
        default_factory=dict
    )
    """Which tools the model sees, by the session's phase (actors/phases.py); empty: every
    tool, always."""
    members: dict[str, MemberConfig] = msgspec.field(default_factory=dict)
    """The agents this one supervises: it gets the ``handoff`` tool to hand them tasks."""
    addressable: bool | None = None
    """Whether messages reach it over HTTP; unset: yes, unless it is a member of a team."""


DEFAULT = Manifest(
    id="assistant",
    name="Assistant",
    instructions=[
        Instruction(
            label="identity",
            text=(
                "You are Assistant, the default agent of a Dispach node. Answer briefly and "
                "plainly. Use the tools when they help: current_time for dates and times, "
                "calculator for arithmetic, session_notes to remember things the person asks "
                "you to keep for later in this conversation."
            ),
        )
    ],
    tools=["current_time", "calculator", "session_notes"],
)
