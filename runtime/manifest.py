"""Agent manifests: ``agents/<id>.yaml`` files, decoded and validated by msgspec, and built into
the agents the engine runs.

Errors name the file, the field and what to do. A default agent (``assistant``) exists out of
the box; a manifest with the same id replaces it. The fields are :mod:`runtime.manifest_schema`;
an agent's tools and pinned prefix, :mod:`runtime.toolset`; its model, the provider registry
(:mod:`gateways.model.providers`); the tool sources it declares besides its own tools, the
registry of their kinds (:mod:`gateways.toolsources`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import structlog
import yaml

from actors.agent import Agent
from actors.budget import Budget
from actors.context.compact import Digester
from actors.context.policy import ContextPolicy
from actors.context.rungs import STAGES
from actors.handoff import Handoffs
from actors.outbox import Channel
from actors.recall import RecallPolicy
from actors.schedule.plan import problems
from actors.tools import ToolSource
from actors.turn.core import Limits
from eventstore.catalogue import Deliver, ErrorDetail
from gateways.channels import build as build_channel
from gateways.manifests import ManifestError
from gateways.model import providers
from runtime import skills, teams
from runtime.manifest_schema import DEFAULT, Manifest
from runtime.manifest_v1 import is_v1, translate
from runtime.toolset import catalogue

__all__ = [
    "DEFAULT",
    "Manifest",
    "ManifestError",
    "build",
    "check_schedules",
    "decode",
    "load_all",
    "load_manifests",
    "load_sources",
    "read_one",
    "version_of",
    "with_tools",
]

log = structlog.get_logger("dispach.agents")


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
    (without the tools of the sources it declares, an MCP server's, which a running node opens:
    see :func:`build`; a supervisor's handoff tool is there, but runs only in a node)."""
    env = dict(os.environ) if env is None else env
    manifests = load_manifests(directory)
    members = teams.members_of(manifests)
    unbound = Handoffs()  # a handoff outside a node says it cannot run
    return {m.id: build(m, env, teams.sources(m, unbound), recall=skills.load(m, directory),
                        addressable=teams.addressable(m, members))
            for m in manifests.values()}  # fmt: skip


def load_manifests(directory: Path | None) -> dict[str, Manifest]:
    """The default agent's manifest plus every ``*.yaml`` one in ``directory``, by id."""
    return {agent_id: read.manifest for agent_id, read in load_sources(directory).items()}


@dataclasses.dataclass(frozen=True)
class Read:
    """A manifest as read from its file: decoded, its text, and its version (content hash)."""

    manifest: Manifest
    text: str
    version: str


DEFAULT_TEXT = msgspec.json.encode(DEFAULT).decode()
"""The default agent's manifest as text (JSON is YAML): what its ``agent.reloaded`` carries."""


def version_of(content: bytes) -> str:
    """A manifest's version: ``sha256:`` and the first 16 hex digits of its bytes' SHA-256."""
    return "sha256:" + hashlib.sha256(content).hexdigest()[:16]


def load_sources(directory: Path | None) -> dict[str, Read]:
    """:func:`load_manifests` with each manifest's text and version."""
    default = Read(DEFAULT, DEFAULT_TEXT, version_of(DEFAULT_TEXT.encode()))
    found = {DEFAULT.id: default}
    for path in _files(directory):
        read = _read(path)
        found[read.manifest.id] = read
    teams.check({agent_id: read.manifest for agent_id, read in found.items()})
    return found


def read_one(directory: Path | None, agent_id: str) -> Read:
    """The manifest of ``agent_id`` as its file holds it now (the default agent's built-in one
    when it has no file): what a reload reads. A broken file is a :class:`ManifestError`."""
    for path in _files(directory):
        if path.stem == agent_id:
            return _read(path)
    if agent_id == DEFAULT.id:
        return load_sources(None)[DEFAULT.id]
    raise ManifestError(
        f"no manifest for agent {agent_id!r} in {directory}: agents/{agent_id}.yaml is gone",
        f"put agents/{agent_id}.yaml back (a node's agents are those it started with)",
        field="id",
    )


def from_text(text: str, source: str, version: str) -> Read:
    """A manifest carried by an ``agent.reloaded`` event (at ``version``), read as its file
    was."""
    return Read(decode(text, source), text, version)


def _files(directory: Path | None) -> list[Path]:
    if directory is None or not directory.is_dir():
        return []
    return sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")])


def _read(path: Path) -> Read:
    content = path.read_bytes()
    manifest = decode(content, str(path))
    if manifest.id != path.stem:
        raise ManifestError(
            f"{path}: id {manifest.id!r} does not match the file name",
            f"name the file {manifest.id}.yaml, or set id: {path.stem}",
            field="id",
        )
    return Read(manifest, content.decode("utf-8", errors="replace"), version_of(content))


def build(manifest: Manifest, env: dict[str, str], sources: Sequence[ToolSource] = (), *,
          recall: RecallPolicy | None = None, addressable: bool = True,
          version: str = "") -> Agent:  # fmt: skip
    """The agent of ``manifest``; ``sources``: the live sources it declares (its MCP servers),
    whose tools (as they last listed them) join its own; ``recall``: its skills as
    :func:`runtime.skills.load` read them (None: none, and its memory as configured);
    ``addressable``: whether messages reach it over HTTP (runtime/teams.py decides, knowing
    every manifest); ``version``: the manifest's content hash."""
    model = providers.model(manifest.model, env, manifest.id, "model")
    policy = _context_policy(manifest)
    provider = providers.chosen(manifest.model, env)
    recall = skills.load(manifest, None) if recall is None else recall
    registry, pinned, phases = catalogue(manifest, model, policy, provider, sources,
                                         skills.pinned_text(recall))  # fmt: skip
    limits = manifest.limits
    agent = Agent(
        id=manifest.id,
        name=manifest.name or manifest.id,
        model=model,
        # The scripted model answers whatever id the manifest names (``auto`` without a key
        # falls back to it): the record says which model really answered.
        model_id="scripted" if provider.name == "scripted" else manifest.model.id,
        max_tokens_per_call=manifest.model.max_output_tokens,
        pinned=pinned,
        tools=registry,
        phases=phases,
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
        digester=_digester(manifest, env),
        reasoning=providers.reasoning(manifest.model, env, manifest.id),
        truncation=manifest.model.truncation,
        budget=Budget(daily_cost_usd=limits.daily_cost_usd, daily_tokens=limits.daily_tokens),
        recall=recall,
        members=tuple(manifest.members),
        addressable=addressable,
        version=version,
    )
    check_schedules(manifest, agent.channels)
    log.info("agent_loaded", agent=agent.id, model=model.label, tools=agent.tools.names,
             channels=sorted(agent.channels),
             skills=[s.id for s in recall.skills])  # fmt: skip
    return agent


def _digester(manifest: Manifest, env: dict[str, str]) -> Digester:
    """What writes the agent's digests: its compactor model, or none (mechanical digests)."""
    compactor = manifest.context.compactor
    if compactor is None:
        return Digester(None, "", 1024)
    model = providers.model(compactor, env, manifest.id, "context.compactor")
    return Digester(model, compactor.id, compactor.max_output_tokens)


def with_tools(agent: Agent, manifest: Manifest, env: dict[str, str],
               sources: Sequence[ToolSource]) -> Agent:  # fmt: skip
    """``agent`` with its tool list built again (a source's tools changed): the same model and
    channels, a new registry and pinned prefix."""
    provider = providers.chosen(manifest.model, env)
    registry, pinned, phases = catalogue(manifest, agent.model, agent.context, provider, sources,
                                         skills.pinned_text(agent.recall))  # fmt: skip
    log.info("agent_tools_changed", agent=agent.id, tools=registry.names)
    return dataclasses.replace(agent, tools=registry, pinned=pinned, phases=phases)


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
            f"order them {' < '.join(STAGES)}, each between 0 and 1",
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
