"""Where an agent's tools come from: one port that the node's own tools (built-ins and Python
functions) and MCP servers (gateways/mcp/client.py) implement, so a new kind of tool lands in
one place.

A source lists its tools as :class:`~actors.tools.spec.ToolSpec` (name, schema, whether it
mutates, its policy, and the ``run`` that calls it); the turn engine calls them through
:func:`~actors.tools.execute.execute`, which bounds each call by its deadline and cancels a
coroutine ``run`` at it; a ``run`` returns text or a :class:`~actors.tools.spec.ToolOutput`
(content blocks, a failure the tool reports), or raises
:class:`~actors.tools.errors.ToolCallFailed` with a code of its own. A source whose list
changes (an MCP server's) is read again when it says so; the agent's registry is then built
anew.

A kind of source that lives beside the node (a session with a server, a process) is a
:class:`ToolSourceKind`: the manifest key that declares it, the check of its declarations, and
the :class:`LiveSources` a node opens for every agent at once, starts, asks, and closes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from actors.tools.spec import ToolSpec

SourceKind = Literal["local", "mcp"]


class ToolSource(Protocol):
    @property
    def name(self) -> str:
        """Which source this is (``local``, or an MCP server's name)."""
        ...

    @property
    def kind(self) -> SourceKind:
        """``local``: the tool runs in the node's process; ``mcp``: in a server's."""
        ...

    def specs(self) -> list[ToolSpec]:
        """The tools this source offers now, in a stable order."""
        ...

    def problems(self) -> list[str]:
        """What an operator should know about the list (an allowed tool the server lacks)."""
        ...


class StaticSource:
    """Tools that are functions in this process (built-ins, operator-written ones): the list
    never changes."""

    kind: SourceKind = "local"

    def __init__(self, name: str, specs: Iterable[ToolSpec]) -> None:
        self._name = name
        self._specs = list(specs)

    @property
    def name(self) -> str:
        return self._name

    def specs(self) -> list[ToolSpec]:
        return list(self._specs)

    def problems(self) -> list[str]:
        return []


SourcesChanged = Callable[[str], None]
"""Told the id of an agent whose live sources now offer other tools."""


class LiveSources(Protocol):
    """The sources of one kind on a node, for every agent that declares some: started with the
    node, closed at its drain; the :data:`SourcesChanged` it was opened with hears when what
    they offer changes."""

    def of(self, agent_id: str) -> list[ToolSource]:
        """The agent's sources of this kind, in the order its manifest declares them."""
        ...

    def warnings(self, agent_id: str) -> list[str]:
        """What keeps the agent's sources from offering their tools now (a server down)."""
        ...

    async def start(self, wait_s: float) -> None:
        """Start them all; wait at most ``wait_s`` for each to list its tools or fail (a slower
        one's tools come later, with a change)."""
        ...

    async def aclose(self, timeout: float) -> None:
        """Stop them all, within ``timeout``."""
        ...


@dataclass(frozen=True)
class ToolSourceKind:
    """A kind of tool source a manifest may declare."""

    key: str
    """The manifest's key: a list of declarations (``mcp_servers``)."""
    declare: Callable[[str, Sequence[Any], Mapping[str, str]], Sequence[Any]]
    """An agent's declarations checked against the node's environment (a ManifestError
    otherwise): ``(agent id, declarations, env)``."""
    open: Callable[[Mapping[str, Sequence[Any]], str, SourcesChanged], LiveSources]
    """The node's live sources for what every agent declared: ``(checked declarations by
    agent, the node's version, whom to tell of a change)``."""
