"""An agent's lifecycle (stream ``agent-<agentId>``): reloaded, stopped, started."""

from __future__ import annotations

from typing import ClassVar

from eventstore.event import Event, register

# --- agents (stream agent-<agentId>) --------------------------------------------------------------


class AgentReloaded(Event, frozen=True):
    """An agent's manifest was read again and its new version swapped in for new turns, on
    every node (turns running keep the version they started with). ``version`` is the content
    hash of the manifest (``sha256:`` and 16 hex digits of the file's bytes); ``manifest`` is
    the text itself, so every node builds the same version whatever its own disk holds, and it
    stays off public streams (a manifest may name hosts and variables)."""

    TYPE: ClassVar[str] = "agent.reloaded"
    PRIVATE: ClassVar[frozenset[str]] = frozenset({"manifest", "previous_manifest"})
    version: str
    previous: str | None = None
    """The version it replaced on the node that read it."""
    previous_manifest: str = ""
    """That version's text: a turn that began on it and resumes after the whole cluster
    restarted (every node then runs its disk's manifest) is built from it again."""
    by: str = "api"
    """Who asked (``api``, ``cli``, or what the caller named itself)."""
    node: str = ""
    """The node that read the manifest from its disk."""
    manifest: str = ""


class AgentStopped(Event, frozen=True):
    """The agent is disabled: every door refuses new messages (``agent_stopped``), schedules
    record their ticks as skipped, turns running or accepted finish. Durable: every node, and
    every node started later, folds it from the log."""

    TYPE: ClassVar[str] = "agent.stopped"
    by: str = "api"
    reason: str | None = None
    node: str = ""


class AgentStarted(Event, frozen=True):
    """A stopped agent takes messages again."""

    TYPE: ClassVar[str] = "agent.started"
    by: str = "api"
    node: str = ""


register(
    AgentReloaded,
    AgentStopped,
    AgentStarted,
)
