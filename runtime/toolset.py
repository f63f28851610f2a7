"""An agent's tools as its manifest and its sources give them: its own (built-ins and Python
functions), those of its live sources (an MCP server's), the provider's server tools, and the
pinned prefix (instructions, a summary of its setup, the tool definitions) that names them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgspec
import structlog

from actors import phases as phasing
from actors.context.assemble import Block, Pinned
from actors.context.policy import ContextPolicy
from actors.model import Model
from actors.phases import Phases
from actors.tools import BUILTINS, StaticSource, ToolRegistry, ToolSource, ToolSpec, load_custom
from gateways.manifests import ManifestError
from gateways.model.config import SERVER_TOOL_TYPES, ServerToolConfig
from gateways.model.providers import Provider, with_server_tools
from runtime.manifest_schema import Instruction, Manifest, ToolConfig

log = structlog.get_logger("dispach.agents")


class PhaseAllowUnmatched(ManifestError):
    code = "phase_allow_unmatched"


def catalogue(
    manifest: Manifest, model: Model, policy: ContextPolicy, provider: Provider,
    sources: Sequence[ToolSource], pinned_skills: str | None = None,
) -> tuple[ToolRegistry, Pinned, Phases | None]:  # fmt: skip
    """The agent's tools, from its sources in order (its own, then its live sources'), its
    pinned prefix (``pinned_skills``: the block of the skills it pins, last), and its phases'
    views when it declares phases. A name its own tools use twice is a manifest error
    (DuplicateTool); a tool of another source whose name is taken already is left out, and said
    so; a phase's allow entry that names no tool fails the load (PhaseAllowUnmatched)."""
    own = [_tool(manifest, t) for t in manifest.tools]
    if (own or sources) and "artifact_read" not in {t.name for t in own}:
        # Compaction shortens old tool results and names this tool to read them whole.
        own.append(BUILTINS["artifact_read"]())
    tools: list[ToolSpec] = []
    taken: set[str] = set()
    for source in [StaticSource("local", own), *sources]:
        for problem in source.problems():
            log.warning("tool_source_problem", agent=manifest.id, source=source.name,
                        problem=problem)  # fmt: skip
        for spec in source.specs():
            if spec.name in taken and source.kind != "local":
                log.warning(f"{source.kind}_tool_refused", agent=manifest.id, server=source.name,
                            tool=spec.name, reason="the agent has a tool of that name")  # fmt: skip
                continue
            taken.add(spec.name)
            tools.append(spec)
    registry = ToolRegistry(tools)
    server = _server_tools(manifest, provider, set(registry.names))
    pinned = _pinned(manifest, model, registry, policy, server, pinned_skills)
    return registry, pinned, _phases(manifest, tools, server, pinned)


def _phases(manifest: Manifest, tools: list[ToolSpec], server: list[dict[str, Any]],
            pinned: Pinned) -> Phases | None:  # fmt: skip
    if not manifest.phases:
        return None
    declared = [phasing.Declared(name, tuple(p.allow), p.entry)
                for name, p in manifest.phases.items()]  # fmt: skip
    entries = [d.name for d in declared if d.entry]
    if len(entries) > 1:
        raise ManifestError(
            f"agent {manifest.id!r}: phases {', '.join(entries)} are all marked entry",
            "mark one phase `entry: true` (or none: sessions then start in the first)",
            field="phases",
        )
    # A server tool is matched by its name, like the agent's own (it has no tags).
    named = [*tools, *(ToolSpec(name=t["name"], description="", input_schema={},
                                mutating=False, run=_never) for t in server)]  # fmt: skip
    missing = phasing.unmatched(declared, named)
    if missing:
        listed = ", ".join(f"phases.{phase}.allow: {entry}" for phase, entry in missing)
        raise PhaseAllowUnmatched(
            f"agent {manifest.id!r}: {len(missing)} phase allow "
            f"{'entry names' if len(missing) == 1 else 'entries name'} no tool: {listed}",
            "an allow entry is a tool's name, tag:<t> (a tag of a tool's `tags`) or *; the "
            f"agent's tools: {', '.join(t.name for t in named) or 'none'}",
            field=f"phases.{missing[0][0]}.allow",
        )
    return phasing.build(declared, tools, server, pinned)


def _never(args: dict[str, Any], ctx: object) -> str:  # pragma: no cover - never run
    raise AssertionError("a stand-in for a server tool's name is never run")


def _pinned(manifest: Manifest, model: Model, tools: ToolRegistry, policy: ContextPolicy,
            server: list[dict[str, Any]], pinned_skills: str | None) -> Pinned:  # fmt: skip
    """The agent's pinned blocks, rendered once: the same bytes every turn."""
    blocks = [
        Block(i.label, i.text) if isinstance(i, Instruction) else Block("instructions", i)
        for i in manifest.instructions
    ]
    blocks = [b for b in blocks if b.text]
    blocks.append(Block("configuration", _configuration(manifest, model, tools, policy)))
    if manifest.reminders:
        blocks.append(Block("reminders", "\n".join(manifest.reminders)))
    if pinned_skills is not None:
        blocks.append(Block("skills (pinned)", pinned_skills))
    return Pinned(system=tuple(blocks), tools=[*tools.definitions(), *server])


def _configuration(manifest: Manifest, model: Model, tools: ToolRegistry,
                   policy: ContextPolicy) -> str:  # fmt: skip
    """A short summary of the agent's own setup, so it can answer questions about itself."""
    specs = [t for name in tools.names if (t := tools.get(name)) is not None]
    asks = [t.name for t in specs if t.policy == "ask"]
    denied = [t.name for t in specs if t.policy == "deny"]
    limits = manifest.limits
    lines = [
        f"About you, as configured: agent {manifest.id!r} ({manifest.name or manifest.id}), "
        f"model {model.label}, context window {policy.window} tokens.",
        (
            f"Tools: {', '.join(t.name for t in specs) or 'none'}."
            if not manifest.phases
            else f"Tools: which you have depends on the conversation's phase "
            f"({', '.join(manifest.phases)})."
        )
        + (f" Each call of {', '.join(asks)} waits for a person's approval." if asks else "")
        + (f" {', '.join(denied)} may not be used." if denied else ""),
        f"Channels: {', '.join(c.id for c in manifest.channels if c.enabled) or 'none'}.",
        f"Each turn may take up to {limits.max_steps} steps and {limits.turn_timeout_s:g} s.",
    ]
    if specs:
        lines.append(
            "Long conversations are compacted automatically: older tool results may be "
            "shortened (artifact_read returns one whole) and older turns summarised; the "
            "person's own requests are kept word for word."
        )
    return "\n".join(lines)


def _server_tools(manifest: Manifest, provider: Provider, ours: set[str]) -> list[dict[str, Any]]:
    """The definitions of the server tools the agent may use (a denied one is left out)."""
    configs = [ServerToolConfig(name=t) if isinstance(t, str) else t
               for t in manifest.model.server_tools]  # fmt: skip
    if configs and not provider.server_tools:
        able = with_server_tools()
        raise ManifestError(
            f"agent {manifest.id!r}: server tools run only on "
            f"{' or '.join(p.title for p in able)}'s API",
            f"remove model.server_tools, or use provider: {' or '.join(p.name for p in able)}",
            field="model.server_tools",
        )
    definitions = []
    for config in configs:
        kind = config.type or SERVER_TOOL_TYPES.get(config.name)
        if kind is None:
            raise ManifestError(
                f"agent {manifest.id!r}: no server tool {config.name!r} is known",
                f"known: {', '.join(SERVER_TOOL_TYPES)}; or give its API `type`",
                field="model.server_tools",
            )
        if config.name in ours:
            raise ManifestError(
                f"agent {manifest.id!r}: server tool {config.name!r} has the name of a tool",
                "rename one of them", field="model.server_tools",
            )  # fmt: skip
        if config.policy == "deny":
            continue
        options = msgspec.to_builtins(config)
        options.pop("policy", None)
        definitions.append({**options, "type": kind, "name": config.name})
    return definitions


def _tool(manifest: Manifest, entry: str | ToolConfig) -> ToolSpec:
    config = entry if isinstance(entry, ToolConfig) else ToolConfig(name=entry)
    if config.module is None:
        factory = BUILTINS.get(config.name)
        if factory is None:
            raise ManifestError(
                f"agent {manifest.id!r}: no built-in tool {config.name!r}",
                f"built-in tools: {', '.join(sorted(BUILTINS))}; or give `module: pkg.mod:func`",
                field="tools",
            )
        spec = factory()
        if config.timeout_s is not None:
            spec = dataclasses.replace(spec, timeout_s=config.timeout_s)
        return dataclasses.replace(
            spec, policy=config.policy, untrusted_output=config.untrusted_output,
            tags=tuple(config.tags),
        )  # fmt: skip
    if config.input_schema is None:
        raise ManifestError(
            f"agent {manifest.id!r}: tool {config.name!r} has a module but no input_schema",
            "give the tool's input as a JSON Schema object under input_schema",
            field="tools",
        )
    custom = load_custom(
        config.name,
        config.module,
        config.description or config.name,
        config.input_schema,
        config.mutating,
        config.timeout_s,
    )
    return dataclasses.replace(
        custom, policy=config.policy, untrusted_output=config.untrusted_output,
        tags=tuple(config.tags),
    )  # fmt: skip
