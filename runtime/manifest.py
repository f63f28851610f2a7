"""Agent manifests: ``agents/<id>.yaml`` files, decoded and validated by msgspec.

Errors name the file, the field and what to do. A default agent (``assistant``) exists out of
the box; a manifest with the same id replaces it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import structlog
import yaml

from actors.agent import Agent
from actors.context.assemble import Block, Pinned
from actors.context.compact import Digester
from actors.context.policy import STAGES, ContextPolicy
from actors.model import Model, Reasoning
from actors.outbox import Channel
from actors.schedule.plan import ScheduleSpec, problems
from actors.tools import BUILTINS, StaticSource, ToolRegistry, ToolSource, ToolSpec, load_custom
from actors.turn.core import Limits
from eventstore.catalogue import Deliver, ErrorDetail
from eventstore.errors import DispachError
from gateways.channels import ChannelConfig
from gateways.channels import build as build_channel
from gateways.mcp.spec import Http, ServerSpec, Stdio
from gateways.model import ScriptedModel, ScriptRule
from runtime.manifest_v1 import is_v1, translate

log = structlog.get_logger("dispach.agents")

Positive = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]
_ID = r"^[a-z0-9][a-z0-9_-]{0,62}$"


class ManifestError(DispachError):
    code = "invalid_manifest"


class ThinkingConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How much the model may think before it answers. Anthropic: ``budget_tokens`` (at least
    1024, below ``max_output_tokens``) or ``adaptive: true``; OpenAI-compatible endpoints:
    ``effort`` (sent as ``reasoning_effort``)."""

    budget_tokens: Annotated[int, msgspec.Meta(ge=1024)] | None = None
    adaptive: bool = False
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


SERVER_TOOL_TYPES = {
    "web_search": "web_search_20250305",
    "web_fetch": "web_fetch_20250910",
    "code_execution": "code_execution_20250825",
}
"""The API's tool type for each server tool's name (``type`` in the manifest overrides it)."""


class ServerToolConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
                       omit_defaults=True):  # fmt: skip
    """A tool the provider runs inside the model call (Anthropic only). The fields after
    ``policy`` are the API's own and go into the tool's definition as given."""

    name: str
    type: str | None = None
    policy: Literal["allow", "deny"] = "allow"
    """``deny`` leaves it out of every request (the API cannot ask a person mid-call, so
    ``ask`` does not exist for server tools)."""
    max_uses: Positive | None = None
    allowed_domains: list[str] | None = None
    blocked_domains: list[str] | None = None
    user_location: dict[str, Any] | None = None
    max_content_tokens: Positive | None = None
    citations: dict[str, Any] | None = None


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    provider: Literal["auto", "anthropic", "openai", "scripted"] = "auto"
    """``auto``: Anthropic when the API key variable is set, else the offline scripted model.
    ``openai``: any endpoint speaking OpenAI's Chat Completions (OpenAI, vLLM, Ollama,
    llama.cpp, OpenRouter), at ``base_url``."""
    id: str = "claude-sonnet-5"
    max_output_tokens: Positive = 4096
    api_key_env: str | None = None
    """The variable holding the API key (default ``ANTHROPIC_API_KEY``, or ``OPENAI_API_KEY``
    for ``provider: openai``). A local OpenAI-compatible server needs none: ``""`` sends
    none (with ``base_url``)."""
    base_url: str | None = None
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=10)] = 2
    stall_timeout_s: Seconds = 120.0
    script: list[ScriptRule] | None = None
    context_window: Positive = 200_000
    """The model's context window in tokens: no request is sent that would not fit."""
    reserve_output: Positive | None = None
    """Tokens of the window kept for the reply (default: max_output_tokens)."""
    thinking: ThinkingConfig | None = None
    truncation: Literal["end", "retry"] = "end"
    """A reply cut off by ``max_output_tokens``: ``end`` the turn ``truncated`` (its text
    kept, a cut-off tool call never run), or ``retry`` once with twice the budget."""
    server_tools: list[str | ServerToolConfig] = msgspec.field(default_factory=list)
    """Anthropic's server tools by name (``web_search``, ``web_fetch``, ``code_execution``) or
    with their options."""
    betas: list[str] = msgspec.field(default_factory=list)
    """Anthropic beta features to switch on (the ``anthropic-beta`` header)."""
    max_tokens_param: Literal["max_completion_tokens", "max_tokens"] = "max_completion_tokens"
    """OpenAI-compatible endpoints: the parameter that carries the output limit (older local
    servers only know ``max_tokens``)."""
    stream_usage: bool = True
    """OpenAI-compatible endpoints: ask for token usage at the end of the stream."""
    reasoning_field: Literal["auto", "reasoning_content", "reasoning", "none"] = "auto"
    """OpenAI-compatible endpoints: where the server streams the model's reasoning
    (``reasoning_content``: vLLM, DeepSeek, llama.cpp; ``reasoning``: OpenRouter)."""

    @property
    def key_env(self) -> str:
        if self.api_key_env is not None:
            return self.api_key_env
        return "OPENAI_API_KEY" if self.provider == "openai" else "ANTHROPIC_API_KEY"


class Instruction(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    text: str
    label: str = "instructions"


class ToolConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    module: str | None = None
    """``package.module:function`` for a tool of your own."""
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    mutating: bool = False
    timeout_s: Seconds | None = None
    policy: Literal["allow", "deny", "ask"] = "allow"
    """``ask``: each call waits for a person's approval (POST …/approvals/{id}); ``deny``: the
    model is told the call was refused."""
    untrusted_output: bool = False
    """What the tool returns comes from outside (a web page, a mail)."""


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


class LimitsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_steps: Positive = 8
    turn_timeout_s: Seconds = 300.0
    tool_timeout_s: Seconds = 30.0
    max_output_tokens: Positive = 32_000
    max_tool_output_chars: Positive = 16_000
    approval_timeout_s: Seconds = 3600.0
    untrusted_on_mutate: Literal["ask", "deny", "allow"] = "ask"


Fraction = Annotated[float, msgspec.Meta(gt=0, lt=1)]


class ThresholdsConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Fractions of the prompt budget (window less output reserve) at which each compaction
    stage starts; strictly ascending in this order."""

    excerpt: Fraction = 0.60
    dedupe: Fraction = 0.70
    stub: Fraction = 0.80
    digest: Fraction = 0.88
    reset: Fraction = 0.95


class ContextConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    thresholds: ThresholdsConfig = ThresholdsConfig()
    excerpt_over_tokens: Positive = 1000
    excerpt_keep_tokens: Positive = 300
    keep_turns: Annotated[int, msgspec.Meta(ge=0, le=100)] = 2
    compactor: ModelConfig | None = None
    """The model that writes digests; without one (or when it fails) digests are mechanical."""
    count_tokens: bool = False
    requests_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.3
    """The share of the prompt budget the verbatim list of earlier requests may take."""


class SessionConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    concurrency: Literal["queue", "reject", "interrupt"] = "queue"


class Manifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    id: Annotated[str, msgspec.Meta(pattern=_ID)]
    name: str | None = None
    model: ModelConfig = ModelConfig()
    instructions: list[str | Instruction] = msgspec.field(default_factory=list)
    reminders: list[str] = msgspec.field(default_factory=list)
    """Rules re-asserted in a pinned block after the instructions and configuration."""
    tools: list[str | ToolConfig] = msgspec.field(default_factory=list)
    mcp_servers: list[McpServerConfig] = msgspec.field(default_factory=list)
    limits: LimitsConfig = LimitsConfig()
    context: ContextConfig = ContextConfig()
    session: SessionConfig = SessionConfig()
    channels: list[ChannelConfig] = msgspec.field(default_factory=list)
    schedules: list[ScheduleSpec] = msgspec.field(default_factory=list)


DEFAULT = Manifest(
    id="assistant",
    name="Assistant",
    instructions=[
        Instruction(
            label="identity",
            text=(
                "You are Assistant, the default agent of a Dispach node. Answer briefly and "
                "plainly. Use the tools when they help: current_time for dates and times, "
                "calculator for arithmetic, session_notes to remember things the person asks "
                "you to keep for later in this conversation."
            ),
        )
    ],
    tools=["current_time", "calculator", "session_notes"],
)


def decode(text: str | bytes, source: str) -> Manifest:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ManifestError(f"{source} is not valid YAML: {e}", "fix the YAML syntax") from e
    if not isinstance(raw, dict):
        raise ManifestError(f"{source} must be a mapping of fields", "start with `id: my-agent`")
    if is_v1(raw):  # written for the original Dispach: read as ours, saying what does not map
        raw, notes = translate(raw)
        for note in notes:
            log.warning("manifest_v1_not_mapped", source=source, note=note)
    try:
        return msgspec.convert(raw, Manifest)
    except msgspec.ValidationError as e:
        found = re.search(r"at `\$\.?([^`]*)`", str(e))
        field = found.group(1) if found else None
        raise ManifestError(
            f"{source}: {e}",
            "see docs/agents.md for the manifest's fields and their types",
            field=field,
        ) from e


def load_all(directory: Path | None, env: dict[str, str] | None = None) -> dict[str, Agent]:
    """The default agent plus every ``*.yaml`` manifest in ``directory``, built into agents
    (without the tools of MCP servers, which a running node's :class:`~gateways.mcp.client.Hub`
    lists: see :func:`build`)."""
    env = dict(os.environ) if env is None else env
    return {m.id: build(m, env) for m in load_manifests(directory).values()}


def load_manifests(directory: Path | None) -> dict[str, Manifest]:
    """The default agent's manifest plus every ``*.yaml`` one in ``directory``, by id."""
    manifests = {DEFAULT.id: DEFAULT}
    if directory is not None and directory.is_dir():
        for path in sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")]):
            manifest = decode(path.read_bytes(), str(path))
            if manifest.id != path.stem:
                raise ManifestError(
                    f"{path}: id {manifest.id!r} does not match the file name",
                    f"name the file {manifest.id}.yaml, or set id: {path.stem}",
                    field="id",
                )
            manifests[manifest.id] = manifest
    return manifests


def build(manifest: Manifest, env: dict[str, str], mcp: Sequence[ToolSource] = ()) -> Agent:
    """The agent of ``manifest``; ``mcp``: the sources of the MCP servers it declares, whose
    tools (as their servers last listed them) join its own."""
    model = _model(manifest.id, manifest.model, env, "model")
    policy = _context_policy(manifest)
    provider = _provider(manifest.model, env)
    registry, pinned = _catalogue(manifest, model, policy, provider, mcp)
    compactor = manifest.context.compactor
    limits = manifest.limits
    agent = Agent(
        id=manifest.id,
        name=manifest.name or manifest.id,
        model=model,
        model_id=manifest.model.id,
        max_tokens_per_call=manifest.model.max_output_tokens,
        pinned=pinned,
        tools=registry,
        limits=Limits(
            max_steps=limits.max_steps,
            turn_timeout_s=limits.turn_timeout_s,
            tool_timeout_s=limits.tool_timeout_s,
            max_output_tokens=limits.max_output_tokens,
            max_tool_output_chars=limits.max_tool_output_chars,
            approval_timeout_s=limits.approval_timeout_s,
            untrusted_on_mutate=limits.untrusted_on_mutate,
        ),
        concurrency=manifest.session.concurrency,
        channels=_channels(manifest, env),
        schedules=tuple(manifest.schedules),
        context=policy,
        digester=Digester(
            _model(manifest.id, compactor, env, "context.compactor") if compactor else None,
            compactor.id if compactor else "",
            compactor.max_output_tokens if compactor else 1024,
        ),
        reasoning=_reasoning(manifest.id, manifest.model, provider),
        truncation=manifest.model.truncation,
    )
    check_schedules(manifest, agent.channels)
    log.info("agent_loaded", agent=agent.id, model=model.label, tools=agent.tools.names,
             channels=sorted(agent.channels))  # fmt: skip
    return agent


def with_tools(agent: Agent, manifest: Manifest, env: dict[str, str],
               mcp: Sequence[ToolSource]) -> Agent:  # fmt: skip
    """``agent`` with its tool list built again (an MCP server's tools changed): the same
    model and channels, a new registry and pinned prefix."""
    provider = _provider(manifest.model, env)
    registry, pinned = _catalogue(manifest, agent.model, agent.context, provider, mcp)
    log.info("agent_tools_changed", agent=agent.id, tools=registry.names)
    return dataclasses.replace(agent, tools=registry, pinned=pinned)


def _catalogue(manifest: Manifest, model: Model, policy: ContextPolicy, provider: str,
               mcp: Sequence[ToolSource]) -> tuple[ToolRegistry, Pinned]:  # fmt: skip
    """The agent's tools, from its sources in order (its own, then its MCP servers'), and its
    pinned prefix. A name its own tools use twice is a manifest error (DuplicateTool); a tool
    of a server whose name is taken already is left out, and said so."""
    own = [_tool(manifest, t) for t in manifest.tools]
    if (own or mcp) and "artifact_read" not in {t.name for t in own}:
        # Compaction shortens old tool results and names this tool to read them whole.
        own.append(BUILTINS["artifact_read"]())
    tools: list[ToolSpec] = []
    taken: set[str] = set()
    for source in [StaticSource("local", own), *mcp]:
        for problem in source.problems():
            log.warning("tool_source_problem", agent=manifest.id, source=source.name,
                        problem=problem)  # fmt: skip
        for spec in source.specs():
            if spec.name in taken and source.kind != "local":
                log.warning("mcp_tool_refused", agent=manifest.id, server=source.name,
                            tool=spec.name, reason="the agent has a tool of that name")  # fmt: skip
                continue
            taken.add(spec.name)
            tools.append(spec)
    registry = ToolRegistry(tools)
    server = _server_tools(manifest, provider, set(registry.names))
    return registry, _pinned(manifest, model, registry, policy, server)


def mcp_servers(manifest: Manifest, env: Mapping[str, str]) -> list[ServerSpec]:
    """The MCP servers ``manifest`` declares, checked, with ``${VAR}`` read from ``env``."""
    specs: list[ServerSpec] = []
    seen: set[str] = set()
    for index, config in enumerate(manifest.mcp_servers):
        where = f"mcp_servers[{index}]"
        if config.name in seen:
            raise ManifestError(f"agent {manifest.id!r}: MCP server {config.name!r} is declared "
                                "twice", "give each server of an agent its own name",
                                field=f"{where}.name")  # fmt: skip
        seen.add(config.name)
        if (config.command is None) == (config.url is None):
            raise ManifestError(
                f"agent {manifest.id!r}: MCP server {config.name!r} needs exactly one of "
                "`command` (a stdio server) and `url` (streamable HTTP)",
                "give `command:` (with `args:`) to run it, or `url:` to reach it", field=where,
            )  # fmt: skip
        transport: Stdio | Http
        if config.command is not None:
            if config.headers:
                raise ManifestError(f"agent {manifest.id!r}: `headers` are for an HTTP server",
                                    "use `env:` to hand a stdio server its secrets",
                                    field=f"{where}.headers")  # fmt: skip
            transport = Stdio(
                command=config.command, args=tuple(config.args), cwd=config.cwd,
                env=tuple((k, _expand(v, env, manifest.id, f"{where}.env.{k}"))
                          for k, v in sorted(config.env.items())),
            )  # fmt: skip
        else:
            url = config.url or ""
            if not url.startswith(("http://", "https://")) or config.env or config.args:
                raise ManifestError(
                    f"agent {manifest.id!r}: MCP server {config.name!r}: `url` must be http(s) "
                    "and takes no `env`/`args`", "e.g. url: https://mcp.example.com/mcp",
                    field=f"{where}.url",
                )  # fmt: skip
            transport = Http(url=url, headers=tuple(
                (k, _expand(v, env, manifest.id, f"{where}.headers.{k}"))
                for k, v in sorted(config.headers.items())
            ))  # fmt: skip
        allowed = None if config.tools is None else frozenset(config.tools)
        stray = sorted(set(config.policy) - allowed) if allowed is not None else []
        if stray:
            raise ManifestError(f"agent {manifest.id!r}: a policy for {', '.join(stray)}, which "
                                f"`tools` of {config.name!r} does not allow",
                                "add them to `tools`, or drop their policy",
                                field=f"{where}.policy")  # fmt: skip
        specs.append(ServerSpec(name=config.name, transport=transport, tools=allowed,
                                policy=dict(config.policy), timeout_s=config.timeout_s,
                                untrusted_output=config.untrusted_output))  # fmt: skip
    return specs


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand(value: str, env: Mapping[str, str], agent: str, field: str) -> str:
    def read(found: re.Match[str]) -> str:
        name = found.group(1)
        if name not in env:
            raise ManifestError(f"agent {agent!r}: {field} reads ${{{name}}}, which is not set",
                                f"set {name} in the node's environment", field=field)  # fmt: skip
        return env[name]

    return _VAR.sub(read, value)


def check_schedules(manifest: Manifest, channels: Mapping[str, Channel]) -> None:
    """Schedules are validated when they are written: for a manifest, at load."""
    seen: set[str] = set()
    now = datetime.now(UTC)
    for index, spec in enumerate(manifest.schedules):
        problem = problems(spec, now=now)
        if problem is None and spec.id in seen:
            problem = ErrorDetail(code="schedule_invalid", field="id",
                                  message=f"schedule id {spec.id!r} is declared twice",
                                  hint="give each schedule of an agent its own id")  # fmt: skip
        deliver = spec.deliver
        if problem is None and isinstance(deliver, Deliver):
            problem = _target_problem(deliver, channels)
        if problem is not None:
            raise ManifestError(
                f"agent {manifest.id!r}, schedule {spec.id!r}: {problem.message}",
                problem.hint,
                field=f"schedules[{index}].{problem.field}" if problem.field else "schedules",
            )
        seen.add(spec.id)


def _target_problem(deliver: Deliver, channels: Mapping[str, Channel]) -> ErrorDetail | None:
    channel = channels.get(deliver.channel)
    if channel is None:
        known = ", ".join(sorted(channels)) or "none"
        return ErrorDetail(code="deliver_invalid", field="deliver.channel",
                           message=f"no channel {deliver.channel!r} on this agent",
                           hint=f"channels of this agent: {known}")  # fmt: skip
    problem = channel.target_problem(deliver.to, deliver.thread)
    if problem is None:
        return None
    return ErrorDetail(code="deliver_invalid", field="deliver.to", message=problem,
                       hint=f"a recipient the {channel.type} channel can reach")  # fmt: skip


def _channels(manifest: Manifest, env: dict[str, str]) -> dict[str, Channel]:
    channels: dict[str, Channel] = {}
    for config in manifest.channels:
        if config.id in channels:
            raise ManifestError(
                f"agent {manifest.id!r} declares channel {config.id!r} twice",
                "give each channel of an agent its own id",
                field="channels",
            )
        if config.enabled:
            channels[config.id] = build_channel(manifest.id, config, env)
    return channels


def _context_policy(manifest: Manifest) -> ContextPolicy:
    config, model = manifest.context, manifest.model
    thresholds = msgspec.structs.astuple(config.thresholds)
    if any(b <= a for a, b in itertools.pairwise(thresholds)):
        named = ", ".join(f"{n} {t:g}" for n, t in zip(STAGES, thresholds, strict=True))
        raise ManifestError(
            f"agent {manifest.id!r}: compaction thresholds must rise stage by stage ({named})",
            "order them excerpt < dedupe < stub < digest < reset, each between 0 and 1",
            field="context.thresholds",
        )
    reserve = model.reserve_output or model.max_output_tokens
    if reserve >= model.context_window:
        raise ManifestError(
            f"agent {manifest.id!r}: the output reserve ({reserve} tokens) leaves no room for a "
            f"prompt in a context window of {model.context_window}",
            "raise model.context_window or lower model.reserve_output / max_output_tokens",
            field="model.reserve_output",
        )
    if config.excerpt_keep_tokens >= config.excerpt_over_tokens:
        raise ManifestError(
            f"agent {manifest.id!r}: an excerpt ({config.excerpt_keep_tokens} tokens) must be "
            f"shorter than the results it shortens (over {config.excerpt_over_tokens})",
            "lower context.excerpt_keep_tokens or raise context.excerpt_over_tokens",
            field="context.excerpt_keep_tokens",
        )
    return ContextPolicy(
        window=model.context_window, reserve_output=reserve, thresholds=thresholds,
        excerpt_over=config.excerpt_over_tokens, excerpt_keep=config.excerpt_keep_tokens,
        keep_turns=config.keep_turns, count_tokens=config.count_tokens,
        requests_share=config.requests_share,
    )  # fmt: skip


def _pinned(manifest: Manifest, model: Model, tools: ToolRegistry, policy: ContextPolicy,
            server: list[dict[str, Any]]) -> Pinned:  # fmt: skip
    """The agent's pinned blocks, rendered once: the same bytes every turn."""
    blocks = [
        Block(i.label, i.text) if isinstance(i, Instruction) else Block("instructions", i)
        for i in manifest.instructions
    ]
    blocks = [b for b in blocks if b.text]
    blocks.append(Block("configuration", _configuration(manifest, model, tools, policy)))
    if manifest.reminders:
        blocks.append(Block("reminders", "\n".join(manifest.reminders)))
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
        f"Tools: {', '.join(t.name for t in specs) or 'none'}."
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


def _model(agent_id: str, config: ModelConfig, env: dict[str, str], where: str) -> Model:
    key = env.get(config.key_env) if config.key_env else None
    provider = _provider(config, env)
    if provider == "scripted":
        script = tuple(config.script) if config.script is not None else None
        return ScriptedModel(script) if script is not None else ScriptedModel()
    if provider == "openai":
        from gateways.model.openai import OpenAIModel  # its SDK loads only for agents using it

        if not key and not config.base_url:
            raise ManifestError(
                f"agent {agent_id!r} uses OpenAI but {config.key_env} is not set",
                f"set {config.key_env}, or give {where}.base_url of a local server",
                field=f"{where}.api_key_env",
            )
        return OpenAIModel(
            config.id,
            # A local server takes any key; the SDK insists on one.
            api_key=key or "unused",
            base_url=config.base_url or env.get("OPENAI_BASE_URL"),
            max_retries=config.max_retries,
            stall_timeout_s=config.stall_timeout_s,
            max_tokens_param=config.max_tokens_param,
            stream_usage=config.stream_usage,
            reasoning_field=config.reasoning_field,
        )
    if not key:
        raise ManifestError(
            f"agent {agent_id!r} uses Anthropic but {config.key_env} is not set",
            f"set {config.key_env}, or use {where}.provider: scripted",
            field=f"{where}.provider",
        )
    # Imported here, as the OpenAI one is: the SDK and its types are ~50 MiB of a node's memory
    # (measured: importing it takes a process from 55 to 108 MiB), paid only by agents using it.
    from gateways.model.anthropic import AnthropicModel

    return AnthropicModel(
        config.id,
        api_key=key,
        base_url=config.base_url or env.get("ANTHROPIC_BASE_URL"),
        max_retries=config.max_retries,
        stall_timeout_s=config.stall_timeout_s,
        betas=tuple(config.betas),
    )


def _provider(config: ModelConfig, env: dict[str, str]) -> str:
    """Which provider the model speaks to: ``auto`` is Anthropic with a key, else scripted."""
    if config.provider != "auto":
        return config.provider
    return "anthropic" if config.key_env and env.get(config.key_env) else "scripted"


def _reasoning(agent_id: str, config: ModelConfig, provider: str) -> Reasoning | None:
    """The model's ``thinking``, checked against what its provider takes."""
    thinking = config.thinking
    if thinking is None or provider == "scripted":
        return None
    field = "model.thinking"
    if provider == "openai":
        if thinking.budget_tokens is not None or thinking.adaptive:
            raise ManifestError(
                f"agent {agent_id!r}: an OpenAI-compatible model takes thinking.effort only",
                "write thinking: {effort: medium} (low, medium, high...)", field=field,
            )  # fmt: skip
        return Reasoning(effort=thinking.effort) if thinking.effort else None
    if thinking.effort is not None:
        raise ManifestError(
            f"agent {agent_id!r}: Anthropic takes thinking.budget_tokens or thinking.adaptive",
            "write thinking: {budget_tokens: 4000} or thinking: {adaptive: true}", field=field,
        )  # fmt: skip
    if thinking.budget_tokens is not None and thinking.budget_tokens >= config.max_output_tokens:
        raise ManifestError(
            f"agent {agent_id!r}: thinking.budget_tokens ({thinking.budget_tokens}) must be "
            f"below model.max_output_tokens ({config.max_output_tokens})",
            "raise model.max_output_tokens (thinking tokens count toward it) or lower the budget",
            field=field,
        )
    if thinking.budget_tokens is None and not thinking.adaptive:
        return None
    return Reasoning(budget_tokens=thinking.budget_tokens, adaptive=thinking.adaptive)


def _server_tools(manifest: Manifest, provider: str, ours: set[str]) -> list[dict[str, Any]]:
    """The definitions of the server tools the agent may use (a denied one is left out)."""
    configs = [ServerToolConfig(name=t) if isinstance(t, str) else t
               for t in manifest.model.server_tools]  # fmt: skip
    if configs and provider != "anthropic":
        raise ManifestError(
            f"agent {manifest.id!r}: server tools run only on Anthropic's API",
            "remove model.server_tools, or use provider: anthropic", field="model.server_tools",
        )  # fmt: skip
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
            spec, policy=config.policy, untrusted_output=config.untrusted_output
        )
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
        custom, policy=config.policy, untrusted_output=config.untrusted_output
    )
