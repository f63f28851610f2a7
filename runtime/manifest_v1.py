"""Manifests written for the original Dispach (TypeScript, ``apiVersion: dispach/v1``), read as
ours.

``translate(raw)`` is pure: it takes the parsed YAML of an original ``agent.yaml`` and returns
our manifest's fields (for ``runtime.manifest.Manifest``) and one note per field it could not
carry over, naming the field and why, for the loader to log. Nothing is dropped silently.

The original takes OpenAI-compatible endpoints as its only model transport, so its model roles
become ``provider: openai`` models (``main`` the agent's, ``compactor`` the digest writer's).
``$ref`` nodes are resolved first, as the original does. Nothing is read from files or the
environment: ``extends`` is not merged, workspace files (the agent's identity) are not read, and
``${VAR}`` references are not expanded (each is noted); the loader can do those before calling.
"""

from __future__ import annotations

import math
import re
from typing import Any

from actors.context.rungs import STAGES
from eventstore.errors import DispachError
from gateways.channels import KINDS as CHANNEL_KINDS

__all__ = ["API_VERSION", "V1ManifestError", "is_v1", "translate"]

API_VERSION = "dispach/v1"
_REF = "$ref"
_ENV = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
_CHARS_PER_TOKEN = 3.8
"""The original's token estimate, which its cut of a long tool observation is measured in."""
_LOCAL_TOOLS = {"now": "current_time", "artifact_read": "artifact_read"}
"""The original's built-in tools that have one of ours."""
_ON_MUTATE = {"refuse": "deny", "confirm": "ask", "allow": "allow"}

_SECTIONS = {
    "extends": "the base manifest is not merged (translate reads no files); merge it in first",
    "knowledge": "keyword-gated knowledge files are not supported",
    "memory": "long-term memory is not supported (session_notes keeps notes per session)",
    "delivery": "there is no default delivery target; each schedule names its own `deliver`",
    "plugins": "plugins are not supported (channels and tools are built in)",
    "server": "the HTTP server is the node's (DISPACH_* settings), not an agent's",
}
_ROLE_FIELDS = {
    "temperature": "sampling parameters are not sent (the endpoint's default applies)",
    "topP": "sampling parameters are not sent (the endpoint's default applies)",
    "headers": "extra request headers are not supported",
}
_CONTEXT_FIELDS = {
    "thresholds": "the original's stages (trim, snip, micro, collapse, reset) are not ours "
    f"(context.thresholds: {', '.join(STAGES)}); our defaults apply",
    "budgets": "workspace budgets have no equivalent (workspace files are not read)",
    "rules": "the rule-count guard has no equivalent",
    "compactionNotice": "our configuration block always says that compaction is automatic",
}
_OURS = " and ".join(kind.type for kind in CHANNEL_KINDS)
"""The channel kinds a manifest of ours may declare, for the note on one of the original's."""
_WORKSPACE_FIELDS = ("workspace", "static", "volatile", "reminder", "soul", "files")


class V1ManifestError(DispachError):
    code = "invalid_manifest"


def is_v1(raw: dict[str, Any]) -> bool:
    """Whether a parsed manifest is in the original's form."""
    return "apiVersion" in raw


def _skills(source: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """``skills: {dir, maxActive}`` as ours (``dir`` relative to the manifest, as v1's): the
    fields to add to ours (none without ``skills``)."""
    if "skills" not in source:
        return {}
    skills = _section(source, "skills")
    out: dict[str, Any] = {}
    if "dir" in skills:
        out["dir"] = skills["dir"]
    if "maxActive" in skills:
        out["max"] = skills["maxActive"]
    for key in skills:
        if key == "threshold":
            notes.append(
                "skills.threshold: no score floor here: a skill sharing a word with "
                "the turn is ranked (Postgres full-text), best first, within skills.max"
            )
        elif key not in ("dir", "maxActive"):
            notes.append(f"skills.{key}: not a field of the v1 schema")
    return {"skills": out}


def translate(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Our manifest's fields for an original ``agent.yaml``, and a note per field not carried
    over (``"<field>: <why>"``)."""
    if raw.get("apiVersion") != API_VERSION:
        raise V1ManifestError(
            f"apiVersion {raw.get('apiVersion')!r} is not one this runtime reads",
            f"an original Dispach manifest says apiVersion: {API_VERSION}",
            field="apiVersion",
        )
    source = _resolve(raw, raw, "", ())
    notes: list[str] = []
    out: dict[str, Any] = {"id": source.get("id")}
    if "name" in source:
        out["name"] = source["name"]
    model = _section(source, "model")
    if not isinstance(model.get("main"), dict):
        raise V1ManifestError(
            "model.main is missing", "give model.main: {id, baseUrl}", field="model.main"
        )
    context = _section(source, "context")
    out["model"] = _role(model["main"], "model.main", context.get("window"), notes)
    _model_extras(out["model"], context, notes)
    ours_context: dict[str, Any] = {}
    if isinstance(model.get("compactor"), dict):
        ours_context["compactor"] = _role(model["compactor"], "model.compactor", None, notes)
    if ours_context:
        out["context"] = ours_context
    if "selector" in model:
        notes.append("model.selector: no tool-selection model here; every tool is offered")
    notes.extend(
        f"model.{k}: not a model role of the v1 schema"
        for k in model
        if k not in ("main", "compactor", "selector")
    )
    limits = _limits(_section(source, "limits"), context, notes)
    tools, on_mutate = _tools(_section(source, "tools"), notes)
    limits["untrusted_on_mutate"] = on_mutate
    out["limits"] = limits
    if tools:
        out["tools"] = tools
    channels = _channels(source.get("channels") or [], notes)
    if channels:
        out["channels"] = channels
    schedules = _schedules(source.get("schedules") or [], {c["id"] for c in channels}, notes)
    if schedules:
        out["schedules"] = schedules
    given = source.get("phases")
    out.update({} if given is None else {"phases": _phases(given, tools, notes)})
    out.update(_skills(source, notes))
    known = {
        "phases",
        "apiVersion",
        "id",
        "name",
        "model",
        "context",
        "limits",
        "tools",
        "channels",
        "schedules",
        "skills",
    }
    for key in source:
        if key in _SECTIONS:
            notes.append(f"{key}: {_SECTIONS[key]}")
        elif key not in known:
            notes.append(f"{key}: not a field of the v1 schema")
    notes.extend(_env_notes(out, ""))
    return out, notes


def _phases(phases: Any, tools: list[Any], notes: list[str]) -> dict[str, Any]:
    """The original's ``phases`` (the same shape as ours), their allow entries named as ours:
    an entry for a tool not carried over, or a tag (the original's tools' tags are not), is
    left out with a note, so the load does not fail on what translate dropped."""
    if not isinstance(phases, dict):
        raise V1ManifestError("phases must be a mapping", "write phases: {name: {allow: [...]}}",
                              field="phases")  # fmt: skip
    carried = {t if isinstance(t, str) else t["name"] for t in tools}
    out: dict[str, Any] = {}
    for name, phase in phases.items():
        if not isinstance(phase, dict) or not isinstance(phase.get("allow"), list):
            raise V1ManifestError(f"phases.{name} has no allow list",
                                  f'write phases.{name}: {{allow: ["*"]}}',
                                  field=f"phases.{name}")  # fmt: skip
        allow = []
        for entry in phase["allow"]:
            ours = _LOCAL_TOOLS.get(entry, entry)
            if ours in ("*", "phase_set") or ours in carried:
                allow.append(ours)
            else:
                notes.append(f"phases.{name}.allow: {entry} is not a tool carried over")
        # A phase left with nothing of its own still shows phase_set (a way out).
        out[name] = {"allow": allow or ["phase_set"],
                     **({"entry": True} if phase.get("entry") is True else {})}  # fmt: skip
    return out


def _section(source: dict[str, Any], key: str) -> dict[str, Any]:
    value = source.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise V1ManifestError(f"{key} must be a mapping", f"write {key}: as fields", field=key)
    return value


def _resolve(node: Any, root: dict[str, Any], path: str, chain: tuple[str, ...]) -> Any:
    """The manifest with every ``{$ref: dotted.path}`` replaced by a copy of what it names
    (itself resolved), as the original does before validation."""
    if isinstance(node, dict) and len(node) == 1 and isinstance(node.get(_REF), str):
        ref = node[_REF]
        if ref in chain:
            raise V1ManifestError(
                f"{path or '(root)'}: $ref {ref!r} refers to itself",
                "break the cycle of $ref",
                field=path,
            )
        target: Any = root
        for segment in ref.split("."):
            if isinstance(target, dict) and segment in target:
                target = target[segment]
            elif isinstance(target, list) and segment.isdigit() and int(segment) < len(target):
                target = target[int(segment)]
            else:
                raise V1ManifestError(
                    f"{path or '(root)'}: $ref {ref!r} names nothing",
                    "point $ref at a field of this manifest, such as model.main",
                    field=path,
                )
        return _resolve(target, root, path, (*chain, ref))
    if isinstance(node, dict):
        return {k: _resolve(v, root, f"{path}.{k}" if path else k, chain) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, root, f"{path}[{i}]", chain) for i, v in enumerate(node)]
    return node


def _role(role: dict[str, Any], where: str, window: Any, notes: list[str]) -> dict[str, Any]:
    """One model role as our ``ModelConfig`` (``window``: the agent's ``context.window``, which
    takes precedence over the role's capability)."""
    ours: dict[str, Any] = {
        "provider": "openai",
        "id": role.get("id"),
        "base_url": role.get("baseUrl"),
    }
    # The original sends no key without an apiKeyEnv: never send OPENAI_API_KEY to an endpoint
    # the manifest did not give one to ("" is "no key" for ours).
    ours["api_key_env"] = role.get("apiKeyEnv") or ""
    if "streamUsage" in role:
        ours["stream_usage"] = role["streamUsage"]
    if "reasoningEffort" in role:
        ours["thinking"] = {"effort": role["reasoningEffort"]}
    capabilities = role.get("capabilities") or {}
    window = window if window is not None else capabilities.get("contextWindow")
    if window is not None:
        ours["context_window"] = window
    elif where == "model.main":
        notes.append(
            "context.window: not given (the original takes it from its model "
            "registry); model.context_window defaults to 200000 tokens here, set it "
            "to the endpoint's window"
        )
    output = role.get("maxTokens", capabilities.get("maxOutput"))
    if output is not None:
        ours["max_output_tokens"] = output
    else:
        notes.append(
            f"{where}.maxTokens: not given (the original then sends no limit); each "
            "call here asks for at most model.max_output_tokens, 4096 by default"
        )
    handled = {
        "id",
        "baseUrl",
        "apiKeyEnv",
        "streamUsage",
        "reasoningEffort",
        "maxTokens",
        "capabilities",
    }
    for key in role:
        if key in _ROLE_FIELDS:
            notes.append(f"{where}.{key}: {_ROLE_FIELDS[key]}")
        elif key not in handled:
            notes.append(f"{where}.{key}: not a field of a v1 model role")
    for key in capabilities:
        if key not in ("contextWindow", "maxOutput"):
            notes.append(
                f"{where}.capabilities.{key}: capability overrides have no equivalent "
                "(tools are always native, thinking is read as the endpoint streams "
                "it)"
            )
    return ours


def _model_extras(model: dict[str, Any], context: dict[str, Any], notes: list[str]) -> None:
    """The ``context`` fields that are ours under ``model``, and notes for the rest."""
    if "reserveOutput" in context:
        model["reserve_output"] = context["reserveOutput"]
    for key in context:
        if key in _CONTEXT_FIELDS:
            notes.append(f"context.{key}: {_CONTEXT_FIELDS[key]}")
        elif key in _WORKSPACE_FIELDS:
            notes.append(
                f"context.{key}: workspace files are not read (the agent's identity "
                "and rules among them); put their text in instructions"
            )
        elif key not in ("window", "reserveOutput", "observationMaxTokens"):
            notes.append(f"context.{key}: not a field of the v1 schema")


def _limits(limits: dict[str, Any], context: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    ours: dict[str, Any] = {}
    if "maxSteps" in limits:
        ours["max_steps"] = limits["maxSteps"]
    for theirs, name in (("turnTimeoutMs", "turn_timeout_s"), ("toolTimeoutMs", "tool_timeout_s")):
        if theirs in limits:
            ours[name] = _number(limits[theirs], f"limits.{theirs}") / 1000
    if "observationMaxTokens" in context:
        tokens = _number(context["observationMaxTokens"], "context.observationMaxTokens")
        # The original cuts one observation to this many tokens at execution time, as
        # characters at its estimate of 3.8 a token (and never below 200).
        ours["max_tool_output_chars"] = max(200, math.ceil(tokens * _CHARS_PER_TOKEN))
    for key in limits:
        if key == "maxParallelTools":
            notes.append("limits.maxParallelTools: read-only tools of a step all run at once")
        elif key not in ("maxSteps", "turnTimeoutMs", "toolTimeoutMs"):
            notes.append(f"limits.{key}: not supported")
    return ours


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise V1ManifestError(
            f"{field} must be a number, not {value!r}", "write a number", field=field
        )
    return float(value)


def _tools(tools: dict[str, Any], notes: list[str]) -> tuple[list[Any], str]:
    """Our tools for the original's built-in ones (``tools.local``) with the policy its rules
    give each, and ``limits.untrusted_on_mutate`` (the original's default: refuse)."""
    policy = tools.get("policy") or {}
    mode = policy.get("mode", "allow")
    allow, deny = policy.get("allow") or [], policy.get("deny") or []
    ours: list[Any] = []
    for slug in tools.get("local") or []:
        name = _LOCAL_TOOLS.get(slug)
        if name is None:
            notes.append(f"tools.local: {slug} has no equivalent here")
            continue
        # Deny first, then allow, then the mode: the original's order (first match wins).
        chosen = "deny" if slug in deny else "allow" if slug in allow else mode
        ours.append(name if chosen == "allow" else {"name": name, "policy": chosen})
    carried = set(_LOCAL_TOOLS) & set(tools.get("local") or [])
    for listed, rules in (("allow", allow), ("deny", deny)):
        rest = [r for r in rules if r not in carried]
        if rest:
            notes.append(
                f"tools.policy.{listed}: rules for tools not carried over, or with "
                f"patterns, are not mapped: {', '.join(map(str, rest))}"
            )
    if "onNoApprover" in policy:
        notes.append(
            "tools.policy.onNoApprover: a call that asks waits for an approval "
            "(limits.approval_timeout_s), whoever is there to give it"
        )
    on_mutate = (tools.get("untrusted") or {}).get("onMutate", "refuse")
    if on_mutate not in _ON_MUTATE:
        raise V1ManifestError(
            f"tools.untrusted.onMutate {on_mutate!r} is not refuse, confirm or allow",
            "write one of them",
            field="tools.untrusted.onMutate",
        )
    why = {
        "dialect": "tools are always sent as the API's native tool calls",
        "providers": "tool providers (system, web, composio) are not supported; tools of your "
        "own are `module:` tools",
        "provider": "tool providers are not supported",
        "providerConfig": "tool providers are not supported",
        "pinned": "",
        "budget": "there is no catalogue budget (every tool listed is offered)",
        "search": "there is no tool search",
    }
    for key, value in tools.items():
        if key == "pinned" and value:
            notes.append(
                f"tools.pinned: provider tools are not supported: {', '.join(map(str, value))}"
            )
        elif key in why and value not in ({}, [], None, {"enabled": False}):
            notes.append(f"tools.{key}: {why[key]}")
        elif key not in why and key not in ("local", "policy", "untrusted"):
            notes.append(f"tools.{key}: not a field of the v1 schema")
    return ours, _ON_MUTATE[on_mutate]


def _channels(channels: list[Any], notes: list[str]) -> list[dict[str, Any]]:
    """Telegram channels as ours (the fields the original's plugin reads); others are noted."""
    fields = {
        "id": "id",
        "enabled": "enabled",
        "mode": "mode",
        "tokenEnv": "token_env",
        "secretTokenEnv": "secret_token_env",
        "allowFrom": "allow_from",
    }
    ours = []
    for index, channel in enumerate(channels):
        where = f"channels[{index}]"
        if not isinstance(channel, dict) or channel.get("type") != "telegram":
            kind = channel.get("type") if isinstance(channel, dict) else channel
            notes.append(f"{where}: a {kind} channel is not supported ({_OURS} are)")
            continue
        ours.append(
            {"type": "telegram", **{fields[k]: v for k, v in channel.items() if k in fields}}
        )
        for key in channel:
            if key not in fields and key != "type":
                notes.append(f"{where}.{key}: not a setting of our telegram channel")
    return ours


def _schedules(schedules: list[Any], channels: set[str], notes: list[str]) -> list[Any]:
    """Schedules as they are (ours take the original's fields and names), but for one that
    delivers to a channel not carried over (the load would refuse it)."""
    ours = []
    for index, schedule in enumerate(schedules):
        deliver = schedule.get("deliver") if isinstance(schedule, dict) else None
        if isinstance(deliver, dict) and deliver.get("channel") not in channels:
            notes.append(
                f"schedules[{index}]: delivers to channel {deliver.get('channel')!r}, "
                "which was not carried over; the schedule is left out"
            )
            continue
        ours.append(schedule)
    return ours


def _env_notes(value: Any, path: str) -> list[str]:
    """A note for each carried-over string holding a ``${VAR}`` reference (not expanded)."""
    if isinstance(value, str):
        found = _ENV.findall(value)
        return (
            [
                f"{path}: {', '.join(found)} is not expanded here; expand it before "
                "translating or write the value"
            ]
            if found
            else []
        )
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in _env_notes(v, f"{path}.{k}" if path else k)]
    if isinstance(value, list):
        return [n for i, v in enumerate(value) for n in _env_notes(v, f"{path}[{i}]")]
    return []
