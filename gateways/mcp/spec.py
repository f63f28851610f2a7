"""What an agent's manifest declares of an MCP server: how to reach it, and what the agent may
use of it. Plain data, cheap to import (the SDK is imported by :mod:`gateways.mcp.client` only
when a manifest declares a server)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["allow", "deny", "ask"]


@dataclass(frozen=True)
class Stdio:
    """A server run as a child process, spoken to on its stdin and stdout."""

    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    """Set over the SDK's minimal default environment (the node's own is not passed on)."""
    cwd: str | None = None

    def describe(self) -> str:
        return " ".join([self.command, *self.args])


@dataclass(frozen=True)
class Http:
    """A server reached over streamable HTTP."""

    url: str
    headers: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        return self.url


@dataclass(frozen=True)
class ServerSpec:
    """One agent's declaration of an MCP server (``mcp_servers`` of its manifest)."""

    name: str
    transport: Stdio | Http
    tools: frozenset[str] | None = None
    """The server's tools the agent may use, by their names on the server; None: all."""
    policy: Mapping[str, Policy] = field(default_factory=dict)
    timeout_s: float | None = None
    untrusted_output: bool = False
