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
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Protocol

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
