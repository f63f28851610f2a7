"""The model providers a manifest may name (``model.provider``), each declared once: the
variable its API key is read from, how its model is built, the thinking it takes, and whether it
runs server tools. A new provider is an adapter module beside this one and one entry in
:data:`PROVIDERS`.

The adapters' SDKs are imported inside the factories: each weighs tens of MiB (the Anthropic
SDK and its types take a process from 55 to 108 MiB), paid only by agents using it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from actors.model import Model, Reasoning
from gateways.manifests import ManifestError
from gateways.model.scripted import ScriptedModel

if TYPE_CHECKING:
    from gateways.model.config import ModelConfig

AUTO = "auto"
"""The provider of a manifest that names none: Anthropic when its key variable is set, else the
offline scripted model."""

Factory = Callable[["ModelConfig", Mapping[str, str], str, str], Model]
"""Builds a provider's model from its config and the node's environment; the agent's id and
where the config sits (``model``, ``context.compactor``) name it in errors."""
Thinking = Callable[["ModelConfig", str], Reasoning | None]
"""The config's ``thinking`` (set) checked against what the provider takes, for the agent."""


@dataclass(frozen=True)
class Provider:
    """One model provider, as manifests see it."""

    name: str
    """``model.provider`` in a manifest."""
    title: str
    """How errors name it: ``Anthropic``."""
    key_env: str
    """The variable holding its API key unless ``model.api_key_env`` names another (``""``:
    it takes none)."""
    model: Factory
    thinking: Thinking
    server_tools: bool = False
    """It runs tools of its own inside the model call (``model.server_tools``)."""


def _anthropic(config: ModelConfig, env: Mapping[str, str], agent_id: str, where: str) -> Model:
    key_env = config.key_env
    key = env.get(key_env) if key_env else None
    if not key:
        raise ManifestError(
            f"agent {agent_id!r} uses Anthropic but {key_env} is not set",
            f"set {key_env}, or use {where}.provider: scripted",
            field=f"{where}.provider",
        )
    from gateways.model.anthropic import AnthropicModel

    return AnthropicModel(
        config.id,
        api_key=key,
        base_url=config.base_url or env.get("ANTHROPIC_BASE_URL"),
        max_retries=config.max_retries,
        stall_timeout_s=config.stall_timeout_s,
        betas=tuple(config.betas),
    )


def _anthropic_thinking(config: ModelConfig, agent_id: str) -> Reasoning | None:
    """A token budget (below the output limit, which thinking counts toward) or adaptive."""
    thinking = config.thinking
    assert thinking is not None, "asked only of a config that thinks"
    if thinking.effort is not None:
        raise ManifestError(
            f"agent {agent_id!r}: Anthropic takes thinking.budget_tokens or thinking.adaptive",
            "write thinking: {budget_tokens: 4000} or thinking: {adaptive: true}",
            field="model.thinking",
        )
    budget = thinking.budget_tokens
    if budget is not None and budget >= config.max_output_tokens:
        raise ManifestError(
            f"agent {agent_id!r}: thinking.budget_tokens ({budget}) must be "
            f"below model.max_output_tokens ({config.max_output_tokens})",
            "raise model.max_output_tokens (thinking tokens count toward it) or lower the budget",
            field="model.thinking",
        )
    if budget is None and not thinking.adaptive:
        return None
    return Reasoning(budget_tokens=budget, adaptive=thinking.adaptive)


def _openai(config: ModelConfig, env: Mapping[str, str], agent_id: str, where: str) -> Model:
    key_env = config.key_env
    key = env.get(key_env) if key_env else None
    if not key and not config.base_url:
        raise ManifestError(
            f"agent {agent_id!r} uses OpenAI but {key_env} is not set",
            f"set {key_env}, or give {where}.base_url of a local server",
            field=f"{where}.api_key_env",
        )
    from gateways.model.openai import OpenAIModel

    return OpenAIModel(
        config.id,
        api_key=key or "unused",  # a local server takes any key; the SDK insists on one
        base_url=config.base_url or env.get("OPENAI_BASE_URL"),
        max_retries=config.max_retries,
        stall_timeout_s=config.stall_timeout_s,
        max_tokens_param=config.max_tokens_param,
        stream_usage=config.stream_usage,
        reasoning_field=config.reasoning_field,
    )


def _openai_thinking(config: ModelConfig, agent_id: str) -> Reasoning | None:
    """An effort (sent as ``reasoning_effort``), nothing else."""
    thinking = config.thinking
    assert thinking is not None, "asked only of a config that thinks"
    if thinking.budget_tokens is not None or thinking.adaptive:
        raise ManifestError(
            f"agent {agent_id!r}: an OpenAI-compatible model takes thinking.effort only",
            "write thinking: {effort: medium} (low, medium, high...)",
            field="model.thinking",
        )
    return Reasoning(effort=thinking.effort) if thinking.effort else None


def _scripted(config: ModelConfig, env: Mapping[str, str], agent_id: str, where: str) -> Model:
    return ScriptedModel(tuple(config.script)) if config.script is not None else ScriptedModel()


def _no_thinking(config: ModelConfig, agent_id: str) -> Reasoning | None:
    """The scripted model does not think; its manifest's thinking is ignored."""
    return None


PROVIDERS: dict[str, Provider] = {
    provider.name: provider
    for provider in (
        Provider(name="anthropic", title="Anthropic", key_env="ANTHROPIC_API_KEY",
                 model=_anthropic, thinking=_anthropic_thinking, server_tools=True),
        Provider(name="openai", title="OpenAI", key_env="OPENAI_API_KEY",
                 model=_openai, thinking=_openai_thinking),
        Provider(name="scripted", title="the scripted model", key_env="",
                 model=_scripted, thinking=_no_thinking),
    )
}  # fmt: skip
"""Every provider by name, in the order the manifest's docs list them."""


def default_key_env(provider: str) -> str:
    """The variable a provider's key is read from when the manifest names none (``auto``:
    Anthropic's)."""
    return PROVIDERS["anthropic" if provider == AUTO else provider].key_env


def chosen(config: ModelConfig, env: Mapping[str, str]) -> Provider:
    """The provider the config's model speaks to (``auto`` resolved against ``env``)."""
    if config.provider != AUTO:
        return PROVIDERS[config.provider]
    key_env = config.key_env
    return PROVIDERS["anthropic" if key_env and env.get(key_env) else "scripted"]


def model(config: ModelConfig, env: Mapping[str, str], agent_id: str, where: str) -> Model:
    """The model of ``config`` (at ``where`` in agent ``agent_id``'s manifest)."""
    return chosen(config, env).model(config, env, agent_id, where)


def reasoning(config: ModelConfig, env: Mapping[str, str], agent_id: str) -> Reasoning | None:
    """The config's ``thinking``, checked against what its provider takes."""
    if config.thinking is None:
        return None
    return chosen(config, env).thinking(config, agent_id)


def with_server_tools() -> list[Provider]:
    """The providers that run server tools."""
    return [p for p in PROVIDERS.values() if p.server_tools]
