"""An agent as the turn engine sees it (built by the runtime from a manifest)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from actors.model import Model
from actors.outbox import Channel
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
    system: list[dict[str, Any]]
    """Pinned instruction blocks, already in the model's format (the stable, cacheable prefix)."""
    tools: ToolRegistry
    limits: Limits
    concurrency: Concurrency = "queue"
    channels: Mapping[str, Channel] = field(default_factory=dict)
    """The agent's delivery channels by id (Telegram, webhook)."""
    schedules: tuple[ScheduleSpec, ...] = ()
    """Schedules the manifest declares (reconciled into the log at start)."""
