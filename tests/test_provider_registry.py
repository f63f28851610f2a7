"""The registries of model providers and tool-source kinds, checked against what a manifest
does with them: each provider's key variable, thinking and server tools give the manifest the
errors (or the agent the settings) they always gave; each tool-source kind's key is a field of
the manifest and its declarations are checked and opened through the registry alone."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from actors.agent import Agent
from actors.model import Reasoning
from gateways.mcp.config import McpServerConfig
from gateways.mcp.sources import McpSources
from gateways.model.config import ModelConfig
from gateways.model.providers import AUTO, PROVIDERS, chosen, default_key_env
from gateways.toolsources import KINDS, Declarations
from runtime.manifest import Manifest, ManifestError, build, decode

KEYS = {"ANTHROPIC_API_KEY": "sk-ant", "OPENAI_API_KEY": "sk-oai"}


def agent(model: str, env: dict[str, str] | None = None) -> Agent:
    manifest = decode(f"id: a\nmodel: {model}\ntools: [calculator]\n", "a.yaml")
    return build(manifest, KEYS if env is None else env)


def refused(model: str, env: dict[str, str] | None = None) -> ManifestError:
    with pytest.raises(ManifestError) as caught:
        agent(model, env)
    assert caught.value.code == "invalid_manifest" and caught.value.hint
    return caught.value


def test_the_manifest_takes_exactly_the_registered_providers_and_auto() -> None:
    for name in [AUTO, *PROVIDERS]:
        assert msgspec.convert({"provider": name}, ModelConfig).provider == name
    error = refused("{provider: telepathy}")
    assert error.field == "model.provider"
    assert "Invalid enum value 'telepathy'" in error.message


@pytest.mark.parametrize(
    ("provider", "label"),
    [("anthropic", "anthropic:m"), ("openai", "openai:m"), ("scripted", "scripted (offline)")],
)
def test_each_provider_builds_its_own_model(provider: str, label: str) -> None:
    assert agent(f"{{provider: {provider}, id: m}}").model.label == label


@pytest.mark.parametrize(
    ("provider", "field"),
    [("anthropic", "model.provider"), ("openai", "model.api_key_env")],
)
def test_a_provider_without_its_key_names_the_variable_it_reads(provider: str, field: str) -> None:
    key_env = PROVIDERS[provider].key_env
    assert default_key_env(provider) == key_env
    error = refused(f"{{provider: {provider}}}", env={})
    assert f"{key_env} is not set" in error.message
    assert error.field == field


def test_the_scripted_model_needs_no_key_and_auto_picks_by_the_key() -> None:
    assert agent("{provider: scripted}", env={}).model.label == "scripted (offline)"
    config = ModelConfig()
    assert config.key_env == PROVIDERS["anthropic"].key_env
    assert chosen(config, {}).name == "scripted"
    assert chosen(config, KEYS).name == "anthropic"


THINKING: list[tuple[str, str, Reasoning | tuple[str, str] | None]] = [
    ("anthropic", "{budget_tokens: 2048}", Reasoning(budget_tokens=2048)),
    ("anthropic", "{adaptive: true}", Reasoning(adaptive=True)),
    ("anthropic", "{}", None),
    ("anthropic", "{effort: high}", ("model.thinking", "budget_tokens or thinking.adaptive")),
    ("anthropic", "{budget_tokens: 8192}", ("model.thinking", "below model.max_output_tokens")),
    ("openai", "{effort: low}", Reasoning(effort="low")),
    ("openai", "{}", None),
    ("openai", "{budget_tokens: 2048}", ("model.thinking", "takes thinking.effort only")),
    ("openai", "{adaptive: true}", ("model.thinking", "takes thinking.effort only")),
    ("scripted", "{effort: low}", None),
    ("scripted", "{budget_tokens: 8192}", None),
]


@pytest.mark.parametrize(("provider", "thinking", "expected"), THINKING)
def test_each_provider_takes_its_own_form_of_thinking(
    provider: str, thinking: str, expected: Reasoning | tuple[str, str] | None
) -> None:
    model = f"{{provider: {provider}, max_output_tokens: 4096, thinking: {thinking}}}"
    if isinstance(expected, tuple):
        field, says = expected
        error = refused(model)
        assert (error.field, says in error.message) == (field, True), error.message
    else:
        assert agent(model).reasoning == expected


@pytest.mark.parametrize("provider", list(PROVIDERS))
def test_server_tools_load_only_on_a_provider_that_runs_them(provider: str) -> None:
    model = f"{{provider: {provider}, server_tools: [web_search]}}"
    if PROVIDERS[provider].server_tools:
        server = [t for t in agent(model).pinned.tools if "type" in t]
        assert server == [{"type": "web_search_20250305", "name": "web_search"}]
    else:
        error = refused(model)
        assert error.field == "model.server_tools"
        assert error.message == "agent 'a': server tools run only on Anthropic's API"
        assert error.hint == "remove model.server_tools, or use provider: anthropic"


def test_each_tool_source_kind_reads_a_field_of_the_manifest() -> None:
    fields = set(Declarations.__struct_fields__)
    assert [kind.key for kind in KINDS] == sorted(fields)
    assert fields <= set(Manifest.__struct_fields__)
    assert len({kind.key for kind in KINDS}) == len(KINDS)


def mcp_manifest(servers: list[dict[str, Any]]) -> Manifest:
    return msgspec.convert({"id": "a", "mcp_servers": servers}, Manifest)


def test_the_mcp_kind_checks_its_declarations_and_opens_live_sources() -> None:
    [kind] = [k for k in KINDS if k.key == "mcp_servers"]
    manifest = mcp_manifest([{"name": "files", "command": "files-server"}])
    assert manifest.mcp_servers == [McpServerConfig(name="files", command="files-server")]
    declared = kind.declare(manifest.id, manifest.mcp_servers, {})
    changed: list[str] = []
    live = kind.open({"a": declared, "b": []}, "test", changed.append)
    assert isinstance(live, McpSources)
    assert [s.name for s in live.of("a")] == ["files"] and live.of("b") == []
    assert live.warnings("a") == ["MCP server 'files' is starting"]
    assert live.warnings("b") == [] and changed == []
    with pytest.raises(ManifestError) as caught:
        kind.declare("a", mcp_manifest([{"name": "x"}]).mcp_servers, {})
    assert caught.value.field == "mcp_servers[0]"
