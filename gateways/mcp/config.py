"""MCP servers as an agent's manifest declares them (``mcp_servers:``), checked into
:class:`~gateways.mcp.spec.ServerSpec`; and MCP as a kind of tool source
(:data:`KIND`). Cheap to import: the SDK loads only when a node opens the servers."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Literal

import msgspec

from actors.tools import LiveSources, SourcesChanged, ToolSourceKind
from gateways.manifests import ManifestError, Seconds
from gateways.mcp.spec import Http, ServerSpec, Stdio


class McpServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An MCP server whose tools the agent uses: a command run over stdio, or a streamable-HTTP
    ``url``. In ``env`` and ``headers``, ``${VAR}`` is read from the node's environment (a
    secret stays out of the manifest)."""

    name: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9][a-z0-9-]{0,30}$")]
    """Its tools are named ``<name>__<tool>``."""
    command: str | None = None
    args: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    tools: list[str] | None = None
    """The server's tools the agent may use, by their names on the server (default: all)."""
    policy: dict[str, Literal["allow", "deny", "ask"]] = msgspec.field(default_factory=dict)
    """Per tool (its name on the server): ``ask`` waits for a person, ``deny`` refuses."""
    timeout_s: Seconds | None = None
    """Each call's deadline (default: ``limits.tool_timeout_s``)."""
    untrusted_output: bool = False


def declare(agent_id: str, configs: Sequence[McpServerConfig],
            env: Mapping[str, str]) -> list[ServerSpec]:  # fmt: skip
    """The MCP servers agent ``agent_id`` declares, checked, with ``${VAR}`` read from
    ``env``."""
    specs: list[ServerSpec] = []
    seen: set[str] = set()
    for index, config in enumerate(configs):
        where = f"mcp_servers[{index}]"
        if config.name in seen:
            raise ManifestError(f"agent {agent_id!r}: MCP server {config.name!r} is declared "
                                "twice", "give each server of an agent its own name",
                                field=f"{where}.name")  # fmt: skip
        seen.add(config.name)
        transport = _transport(agent_id, config, env, where)
        allowed = None if config.tools is None else frozenset(config.tools)
        stray = sorted(set(config.policy) - allowed) if allowed is not None else []
        if stray:
            raise ManifestError(f"agent {agent_id!r}: a policy for {', '.join(stray)}, which "
                                f"`tools` of {config.name!r} does not allow",
                                "add them to `tools`, or drop their policy",
                                field=f"{where}.policy")  # fmt: skip
        specs.append(ServerSpec(name=config.name, transport=transport, tools=allowed,
                                policy=dict(config.policy), timeout_s=config.timeout_s,
                                untrusted_output=config.untrusted_output))  # fmt: skip
    return specs


def _transport(agent_id: str, config: McpServerConfig, env: Mapping[str, str],
               where: str) -> Stdio | Http:  # fmt: skip
    """How the node reaches the server: exactly one of a command and a URL."""
    if (config.command is None) == (config.url is None):
        raise ManifestError(
            f"agent {agent_id!r}: MCP server {config.name!r} needs exactly one of "
            "`command` (a stdio server) and `url` (streamable HTTP)",
            "give `command:` (with `args:`) to run it, or `url:` to reach it", field=where,
        )  # fmt: skip
    if config.command is not None:
        if config.headers:
            raise ManifestError(f"agent {agent_id!r}: `headers` are for an HTTP server",
                                "use `env:` to hand a stdio server its secrets",
                                field=f"{where}.headers")  # fmt: skip
        return Stdio(
            command=config.command, args=tuple(config.args), cwd=config.cwd,
            env=tuple((k, _expand(v, env, agent_id, f"{where}.env.{k}"))
                      for k, v in sorted(config.env.items())),
        )  # fmt: skip
    url = config.url or ""
    if not url.startswith(("http://", "https://")) or config.env or config.args:
        raise ManifestError(
            f"agent {agent_id!r}: MCP server {config.name!r}: `url` must be http(s) "
            "and takes no `env`/`args`", "e.g. url: https://mcp.example.com/mcp",
            field=f"{where}.url",
        )  # fmt: skip
    return Http(url=url, headers=tuple(
        (k, _expand(v, env, agent_id, f"{where}.headers.{k}"))
        for k, v in sorted(config.headers.items())
    ))  # fmt: skip


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand(value: str, env: Mapping[str, str], agent: str, field: str) -> str:
    def read(found: re.Match[str]) -> str:
        name = found.group(1)
        if name not in env:
            raise ManifestError(f"agent {agent!r}: {field} reads ${{{name}}}, which is not set",
                                f"set {name} in the node's environment", field=field)  # fmt: skip
        return env[name]

    return _VAR.sub(read, value)


def _open(declared: Mapping[str, Sequence[ServerSpec]], version: str,
          changed: SourcesChanged) -> LiveSources:  # fmt: skip
    from gateways.mcp.sources import McpSources  # the SDK loads only for a node that uses it

    return McpSources(declared, version, changed)


KIND = ToolSourceKind(key="mcp_servers", declare=declare, open=_open)
"""MCP servers, one session per declared server per node (:mod:`gateways.mcp.client`)."""
