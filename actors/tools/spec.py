"""What a tool is (:class:`ToolSpec`), what it sees while it runs (:class:`ToolContext`) and what
running it produced (:class:`ToolOutcome`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

from actors.tools.notes import Notes


class ToolContext(Protocol):
    """The turn a tool call belongs to, and the session state a tool may touch."""

    @property
    def agent_id(self) -> str: ...

    @property
    def session_key(self) -> str: ...

    @property
    def turn_id(self) -> str: ...

    @property
    def call_id(self) -> str: ...

    @property
    def notes(self) -> Notes: ...

    @property
    def artifacts(self) -> Artifacts: ...

    @property
    def phases(self) -> PhaseSwitch | None:
        """The session's phase, for ``phase_set`` (None: the agent has no phases)."""
        ...


class PhaseSwitch(Protocol):
    """The door of ``phase_set`` to its turn (the turn runner holds the turn's phase)."""

    async def set(self, to: str) -> int:
        """Move the session to phase ``to`` from the turn's next model call on; returns how many
        tools that phase shows."""
        ...


class Artifacts(Protocol):
    """The whole bodies of the session's tool results, which compaction may have shortened."""

    async def read(self, obs_id: str) -> str | None:
        """The result of tool call ``obs_id`` as stored, or None if the session has none."""
        ...


@dataclass(frozen=True)
class ToolOutput:
    """What a tool returns when plain text is not enough: content blocks beside the text (an
    image), or a failure the tool itself reports (MCP's ``isError``), which the model reads as a
    tool error, not as a crash."""

    text: str
    """What the model reads: the tool's text, with a note in place of each block it cannot
    read as text."""
    blocks: tuple[dict[str, Any], ...] = ()
    """Anthropic content blocks the model takes beside ``text`` (``image``); empty: the text
    alone."""
    error: bool = False


ToolRun = Callable[[dict[str, Any], ToolContext], str | ToolOutput | Awaitable[str | ToolOutput]]
"""A tool's body: validated arguments in, the text the model reads out (or a
:class:`ToolOutput`). A plain function runs in a worker thread; a coroutine function runs on the
event loop and must not block it."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    input_schema: dict[str, Any]
    mutating: bool
    """It changes something outside the turn: such calls run one at a time, in the model's order."""
    run: ToolRun
    timeout_s: float | None = None
    """None: the turn's default timeout."""
    untrusted_output: bool = False
    """What it returns comes from outside (a fetched page, a mail): once it is in a turn,
    mutating calls of that turn need approval (see Limits.untrusted_on_mutate)."""
    policy: Literal["allow", "deny", "ask"] = "allow"
    """``deny``: never run (the model is told it was refused); ``ask``: each call waits for a
    person's approval."""
    mcp_server: str | None = None
    """The MCP server that runs it (its events say ``source: "mcp"``); None: a tool of this
    process."""
    tags: tuple[str, ...] = ()
    """What a phase's ``allow`` matches as ``tag:<t>`` (the manifest's ``tags``)."""


class ToolOutcome(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    output: str
    """What the model reads: the tool's text, or what went wrong; cut to the turn's limit."""
    truncated: bool
    bytes: int
    """UTF-8 size of the whole output, before it was cut."""
    latency_ms: int
    error_code: str | None = None
    """Why ``ok`` is false: ``tool_timeout``, ``tool_failed``, ``tool_error`` (the tool said it
    failed) or a code the tool raised (``tool_unavailable``) from :func:`execute`, or
    ``tool_cancelled`` when the turn engine records a call its stopping turn cut short."""
    content: list[dict[str, Any]] | None = None
    """The result as content blocks (text and images) when it is not text alone."""
