"""An agent as the turn engine sees it (built by the runtime from a manifest)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from actors.budget import Budget
from actors.context.assemble import Pinned
from actors.context.compact import Digester
from actors.context.policy import ContextPolicy
from actors.model import Model, Reasoning
from actors.outbox import Channel
from actors.phases import Phases, PhaseView
from actors.recall import RecallPolicy
from actors.schedule.plan import ScheduleSpec
from actors.tools import ToolRegistry
from actors.turn.core import Limits

Concurrency = Literal["queue", "reject", "interrupt"]


@dataclass(frozen=True)
class Agent:
    id: str
    name: str
    model: Model
    model_id: str
    max_tokens_per_call: int
    pinned: Pinned
    """Instructions, configuration, reminders and the tool catalogue: the stable prefix."""
    tools: ToolRegistry
    limits: Limits
    phases: Phases | None = None
    """The manifest's phases, each phase's tools and pinned prefix (None: no phases)."""
    concurrency: Concurrency = "queue"
    channels: Mapping[str, Channel] = field(default_factory=dict)
    """The agent's delivery channels by id (Telegram, webhook)."""
    schedules: tuple[ScheduleSpec, ...] = ()
    """Schedules the manifest declares (reconciled into the log at start)."""
    context: ContextPolicy = field(default_factory=ContextPolicy)
    digester: Digester = field(default_factory=Digester)
    """Writes the digests of compacted turns (with the compactor model, if one is set)."""
    reasoning: Reasoning | None = None
    """How much the model may think (the manifest's ``model.thinking``); None: not asked."""
    members: tuple[str, ...] = ()
    """The agents it hands tasks to with its ``handoff`` tool (actors/handoff/)."""
    addressable: bool = True
    """Whether messages reach it over HTTP (a team's member, by default, is not)."""
    version: str = ""
    """The content hash of the manifest it was built from (``model.call.agent_version``)."""
    truncation: Literal["end", "retry"] = "end"
    """What a reply cut off by the per-call output limit does: end the turn ``truncated``, or
    go once more with twice the budget."""
    recall: RecallPolicy = field(default_factory=RecallPolicy)
    """Its skills and how a turn selects them and the session's notes (actors/recall.py)."""
    budget: Budget = field(default_factory=Budget)
    """The manifest's daily limits (``limits.daily_cost_usd``, ``limits.daily_tokens``)."""

    def view(self, phase: str | None) -> PhaseView:
        """What a session in ``phase`` (None: the entry phase) offers its model: the phase's
        pinned prefix and the registry that checks its calls; without phases, every tool."""
        if self.phases is None:
            return PhaseView("", self.pinned, self.tools)
        return self.phases.view(phase)
