"""Agent manifests: decoded by msgspec, errors that name the file, the field and a hint."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.manifest import DEFAULT, ManifestError, decode, load_all


def test_the_default_agent_is_offline_without_a_key_and_says_so() -> None:
    agents = load_all(None, env={})
    assert set(agents) == {"assistant"}
    assistant = agents["assistant"]
    assert assistant.model.label == "scripted (offline)"
    assert assistant.tools.names == ["current_time", "calculator", "session_notes", "artifact_read"]
    assert [b.label for b in assistant.pinned.system] == ["identity", "configuration"]
    assert "scripted (offline)" in assistant.pinned.system[-1].text


def test_the_default_agent_uses_anthropic_when_a_key_is_set() -> None:
    agents = load_all(None, env={"ANTHROPIC_API_KEY": "sk-test"})
    assert agents["assistant"].model.label == f"anthropic:{DEFAULT.model.id}"


def test_a_manifest_directory_adds_and_replaces_agents(tmp_path: Path) -> None:
    (tmp_path / "helper.yaml").write_text(
        "id: helper\nmodel: {provider: scripted}\ntools: [calculator]\n"
        "limits: {max_steps: 3, turn_timeout_s: 9}\nsession: {concurrency: reject}\n"
    )
    (tmp_path / "assistant.yaml").write_text("id: assistant\nname: Mine\n")
    agents = load_all(tmp_path, env={})
    assert set(agents) == {"assistant", "helper"}
    helper = agents["helper"]
    assert (helper.limits.max_steps, helper.limits.turn_timeout_s) == (3, 9)
    assert helper.concurrency == "reject"
    assert agents["assistant"].name == "Mine"


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("id: x\nlimits: {max_steps: 0}\n", "limits.max_steps", ">= 1"),
        ("id: x\nlimits: {max_steps: many}\n", "limits.max_steps", "Expected `int`"),
        ("id: x\nsession: {concurrency: sometimes}\n", "session.concurrency", "sometimes"),
        ("id: x\nmodle: {}\n", None, "modle"),
        ("id: Bad Id\n", "id", "matching regex"),
    ],
)
def test_errors_name_the_field(text: str, field: str | None, fragment: str) -> None:
    with pytest.raises(ManifestError) as caught:
        decode(text, "agents/x.yaml")
    error = caught.value
    assert error.code == "invalid_manifest"
    assert "agents/x.yaml" in error.message and fragment in error.message
    assert error.hint
    if field is not None:
        assert error.field == field


def test_unknown_tools_missing_keys_and_mismatched_ids_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("id: a\ntools: [teleport]\n")
    with pytest.raises(ManifestError, match="no built-in tool 'teleport'"):
        load_all(tmp_path, env={})
    (tmp_path / "a.yaml").write_text("id: b\n")
    with pytest.raises(ManifestError, match="does not match the file name"):
        load_all(tmp_path, env={})
    (tmp_path / "a.yaml").write_text("id: a\nmodel: {provider: anthropic}\n")
    with pytest.raises(ManifestError, match="ANTHROPIC_API_KEY is not set"):
        load_all(tmp_path, env={})
    (tmp_path / "a.yaml").write_text("id: a\ntools: [{name: x, module: 'no.such:thing'}]\n")
    with pytest.raises(ManifestError, match="input_schema"):
        load_all(tmp_path, env={})


def test_yaml_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(ManifestError, match="mapping"):
        decode("- a list\n", "agents/x.yaml")
    with pytest.raises(ManifestError, match="not valid YAML"):
        decode("id: [unclosed\n", "agents/x.yaml")
