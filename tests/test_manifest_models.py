"""The model section of a manifest: providers, thinking, server tools, truncation, each checked
at load against what its provider takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from actors.model import Reasoning
from gateways.model.anthropic import thinking_param
from runtime.manifest import ManifestError, load_all

KEYS = {"ANTHROPIC_API_KEY": "sk-ant", "OPENAI_API_KEY": "sk-oai"}


def agent(tmp_path: Path, model: str, env: dict[str, str] | None = None) -> Any:
    (tmp_path / "a.yaml").write_text(f"id: a\nmodel: {model}\ntools: [calculator]\n")
    return load_all(tmp_path, env=KEYS if env is None else env)["a"]


def test_anthropic_thinking_server_tools_and_truncation(tmp_path: Path) -> None:
    loaded = agent(tmp_path, "{provider: anthropic, max_output_tokens: 8000, truncation: retry,"
                   " thinking: {budget_tokens: 4000}, server_tools: [web_search,"
                   " {name: web_fetch, max_uses: 2, allowed_domains: [example.com]},"
                   " {name: code_execution, policy: deny}]}")  # fmt: skip
    assert loaded.reasoning == Reasoning(budget_tokens=4000)
    assert loaded.truncation == "retry"
    server = [t for t in loaded.pinned.tools if "type" in t]
    assert server == [
        {"type": "web_search_20250305", "name": "web_search"},
        {
            "type": "web_fetch_20250910",
            "name": "web_fetch",
            "max_uses": 2,
            "allowed_domains": ["example.com"],
        },
    ]  # fmt: skip  (a denied one is in no request)
    assert loaded.tools.names == ["calculator", "artifact_read"]  # server tools run remotely


def test_openai_effort_and_a_local_server_without_a_key(tmp_path: Path) -> None:
    loaded = agent(tmp_path, "{provider: openai, id: qwen3, base_url: 'http://127.0.0.1:8000/v1',"
                   " api_key_env: '', thinking: {effort: low}}", env={})  # fmt: skip
    assert loaded.model.label == "openai:qwen3"
    assert loaded.reasoning == Reasoning(effort="low")


@pytest.mark.parametrize(
    ("model", "field", "fragment"),
    [
        ("{provider: anthropic, max_output_tokens: 2048, thinking: {budget_tokens: 4000}}",
         "model.thinking", "below model.max_output_tokens"),
        ("{provider: anthropic, thinking: {effort: high}}", "model.thinking", "budget_tokens"),
        ("{provider: openai, thinking: {budget_tokens: 2048}}", "model.thinking", "effort"),
        ("{provider: openai, server_tools: [web_search]}", "model.server_tools", "Anthropic"),
        ("{provider: anthropic, server_tools: [telepathy]}", "model.server_tools", "telepathy"),
        ("{provider: anthropic, server_tools: [{name: calculator, type: web_search_20250305}]}",
         "model.server_tools", "name of a tool"),
        ("{provider: anthropic, thinking: {budget_tokens: 100}}", "model.thinking.budget_tokens",
         ">= 1024"),
    ],
)  # fmt: skip
def test_what_a_provider_does_not_take_is_refused_at_load(
    tmp_path: Path, model: str, field: str, fragment: str
) -> None:
    with pytest.raises(ManifestError) as caught:
        agent(tmp_path, model)
    assert caught.value.field == field
    assert fragment in caught.value.message
    assert caught.value.hint


def test_openai_without_a_key_or_a_local_server_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ManifestError) as caught:
        agent(tmp_path, "{provider: openai}", env={})
    assert "OPENAI_API_KEY" in caught.value.message


@pytest.mark.parametrize(
    ("reasoning", "max_tokens", "expected"),
    [
        (None, 4096, None),
        (Reasoning(adaptive=True), 4096, {"type": "adaptive"}),
        (Reasoning(budget_tokens=2048), 4096, {"type": "enabled", "budget_tokens": 2048}),
        # Less room left in the turn: the budget shrinks below the call's max_tokens...
        (Reasoning(budget_tokens=2048), 1500, {"type": "enabled", "budget_tokens": 1499}),
        # ...and a call without room for the API's smallest budget does not think.
        (Reasoning(budget_tokens=2048), 1024, None),
        (Reasoning(effort="high"), 4096, None),  # OpenAI's knob: nothing for Anthropic
    ],
)
def test_the_thinking_parameter_of_each_call(
    reasoning: Reasoning | None, max_tokens: int, expected: dict[str, Any] | None
) -> None:
    assert thinking_param(reasoning, max_tokens) == expected
