"""The kinds of tool source a manifest may declare beside its own tools, in one place: a new
kind is a module of its own (its declarations' type, their check, its live sources), one field
of :class:`Declarations` under the manifest key it reads, and its entry in :data:`KINDS`."""

from __future__ import annotations

import msgspec

from actors.tools import ToolSourceKind
from gateways.mcp import config as mcp
from gateways.mcp.config import McpServerConfig


class Declarations(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The manifest's fields that declare tool sources, one per kind (named by its key)."""

    mcp_servers: list[McpServerConfig] = msgspec.field(default_factory=list)


KINDS: tuple[ToolSourceKind, ...] = (mcp.KIND,)
"""Every kind, in the order an agent's tools take theirs (after its own)."""
