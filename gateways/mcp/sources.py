"""The MCP servers of a node's agents as :class:`~actors.tools.LiveSources`: one
:class:`~gateways.mcp.client.Hub` of connections, and each agent's declarations as tool
sources over them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from actors.tools import SourcesChanged, ToolSource
from gateways.mcp.client import Connection, Hub, McpTools
from gateways.mcp.spec import ServerSpec


class McpSources:
    """Every agent's MCP servers on this node (agents that declare the same server the same
    way share its session)."""

    def __init__(self, declared: Mapping[str, Sequence[ServerSpec]], version: str,
                 changed: SourcesChanged) -> None:  # fmt: skip
        self.hub = Hub(client_version=version, on_change=self._on_change)
        self._changed = changed
        self._by_agent: dict[str, list[McpTools]] = {
            agent_id: [self.hub.source(spec) for spec in specs]
            for agent_id, specs in declared.items()
        }

    def of(self, agent_id: str) -> list[ToolSource]:
        return list(self._by_agent.get(agent_id, ()))

    def warnings(self, agent_id: str) -> list[str]:
        return [f"MCP server {s.name!r} is {s.connection.state}"
                + (f": {s.connection.error}" if s.connection.error else "")
                for s in self._by_agent.get(agent_id, ())
                if s.connection.state != "up"]  # fmt: skip

    async def start(self, wait_s: float) -> None:
        await self.hub.start(wait_s)

    async def aclose(self, timeout: float) -> None:
        await self.hub.aclose(timeout)

    def _on_change(self, connection: Connection) -> None:
        """A server listed other tools (it came up, came back, or said they changed): each
        agent that uses it is told."""
        for agent_id, sources in self._by_agent.items():
            if any(s.connection is connection for s in sources):
                self._changed(agent_id)
