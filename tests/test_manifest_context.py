"""The manifest's context fields: the model's window and output reserve, the compaction ladder,
reminders, the compactor model, and the pinned blocks and tools an agent is built with."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from actors.agent import Agent
from actors.context.compact import DIGEST_INSTRUCTION
from actors.context.history import Entry, entry
from actors.context.rungs import DEFAULT_THRESHOLDS
from runtime.manifest import ManifestError, build, decode
from tests import fakes
from tests.fakes import FakeAnthropic, HttpError, Reply

fake_anthropic = fakes.fake_anthropic


def agent(text: str, env: dict[str, str] | None = None) -> Agent:
    return build(decode(text, "x.yaml"), env={} if env is None else env)


def refused(text: str) -> ManifestError:
    """The error decoding or building the manifest raises."""
    with pytest.raises(ManifestError) as caught:
        agent(text)
    error = caught.value
    assert error.code == "invalid_manifest" and error.hint
    return error


def covered() -> list[Entry]:
    """One turn, as a digest covers it: a request, a lookup and its result, a reply."""
    call = {"type": "tool_use", "id": "c1", "name": "lookup", "input": {"n": 42}}
    found = {"type": "tool_result", "tool_use_id": "c1", "content": "order 42: shipped",
             "is_error": False}  # fmt: skip
    return [
        entry("t1", 10, "user", {"type": "text", "text": "Find order 42"}),
        entry("t1", 10, "assistant", [call]),
        entry("t1", 10, "tool", found),
        entry("t1", 10, "assistant", [{"type": "text", "text": "It has shipped."}]),
    ]


def test_the_manifests_in_docs_agents_md_decode() -> None:
    docs = (Path(__file__).parent.parent / "docs" / "agents.md").read_text()
    manifests = [
        b for b in re.findall(r"```yaml\n(.*?)```", docs, re.DOTALL) if b.startswith("id:")
    ]
    assert len(manifests) >= 2
    for text in manifests:
        manifest = decode(text, "docs/agents.md")
        assert msgspec.structs.astuple(manifest.context.thresholds)[0] == 0.60
    researcher = decode(manifests[-1], "docs/agents.md")
    assert researcher.reminders and researcher.context.compactor is not None


def test_the_context_fields_become_the_agents_policy() -> None:
    built = agent(
        "id: x\nmodel: {provider: scripted, context_window: 50000, reserve_output: 2000}\n"
        "context:\n"
        "  thresholds: {excerpt: 0.5, dedupe: 0.6, stub: 0.7, digest: 0.8, reset: 0.9}\n"
        "  excerpt_over_tokens: 500\n  excerpt_keep_tokens: 100\n  keep_turns: 0\n"
        "  count_tokens: true\n"
    )
    policy = built.context
    assert (policy.window, policy.reserve_output, policy.budget) == (50_000, 2000, 48_000)
    assert policy.thresholds == (0.5, 0.6, 0.7, 0.8, 0.9)
    assert (policy.excerpt_over, policy.excerpt_keep) == (500, 100)
    assert (policy.keep_turns, policy.count_tokens) == (0, True)


def test_the_defaults_reserve_max_output_tokens_and_use_the_default_ladder() -> None:
    policy = agent("id: x\nmodel: {provider: scripted, max_output_tokens: 8000}\n").context
    assert (policy.window, policy.reserve_output) == (200_000, 8000)
    assert policy.thresholds == DEFAULT_THRESHOLDS
    assert (policy.excerpt_over, policy.excerpt_keep, policy.keep_turns) == (1000, 300, 2)
    assert policy.count_tokens is False


@pytest.mark.parametrize(
    "thresholds",
    [
        "{dedupe: 0.5}",  # below excerpt's default 0.60
        "{excerpt: 0.7, dedupe: 0.7}",  # equal is not rising
        "{digest: 0.97}",  # above reset's default 0.95
    ],
)
def test_thresholds_must_rise_stage_by_stage(thresholds: str) -> None:
    error = refused(f"id: x\ncontext: {{thresholds: {thresholds}}}\n")
    assert error.field == "context.thresholds"
    assert "must rise stage by stage" in error.message
    assert "excerpt < dedupe < stub < digest < reset" in error.hint


@pytest.mark.parametrize(
    ("thresholds", "field"),
    [
        ("{stub: 1.2}", "context.thresholds.stub"),
        ("{reset: 1}", "context.thresholds.reset"),
        ("{excerpt: 0}", "context.thresholds.excerpt"),
        ("{dedupe: -0.1}", "context.thresholds.dedupe"),
    ],
)
def test_a_threshold_outside_zero_to_one_names_its_field(thresholds: str, field: str) -> None:
    with pytest.raises(ManifestError) as caught:
        decode(f"id: x\ncontext: {{thresholds: {thresholds}}}\n", "x.yaml")
    assert caught.value.field == field
    assert "x.yaml" in caught.value.message


@pytest.mark.parametrize(
    "model",
    [
        "{provider: scripted, context_window: 4000, reserve_output: 4000}",
        "{provider: scripted, context_window: 4000, reserve_output: 9000}",
        "{provider: scripted, context_window: 4000}",  # reserve defaults to max_output_tokens 4096
    ],
)
def test_an_output_reserve_that_fills_the_window_is_refused(model: str) -> None:
    error = refused(f"id: x\nmodel: {model}\n")
    assert error.field == "model.reserve_output"
    assert "context window of 4000" in error.message


@pytest.mark.parametrize(("keep", "over"), [(300, 300), (800, 500)])
def test_an_excerpt_must_be_shorter_than_what_it_shortens(keep: int, over: int) -> None:
    error = refused(
        f"id: x\ncontext: {{excerpt_keep_tokens: {keep}, excerpt_over_tokens: {over}}}\n"
    )
    assert error.field == "context.excerpt_keep_tokens"


@pytest.mark.parametrize(
    ("context", "field"),
    [
        ("{keep_turns: 101}", "context.keep_turns"),
        ("{keep_turns: -1}", "context.keep_turns"),
        ("{excerpt_over_tokens: 0}", "context.excerpt_over_tokens"),
        ("{thresholds: {compress: 0.5}}", "context.thresholds"),
    ],
)
def test_other_context_mistakes_name_their_field(context: str, field: str) -> None:
    with pytest.raises(ManifestError) as caught:
        decode(f"id: x\ncontext: {context}\n", "x.yaml")
    assert caught.value.field == field


def test_artifact_read_comes_with_tools_and_only_with_tools() -> None:
    with_tools = agent("id: x\nmodel: {provider: scripted}\ntools: [calculator]\n")
    assert with_tools.tools.names == ["calculator", "artifact_read"]
    assert [t["name"] for t in with_tools.pinned.tools] == ["calculator", "artifact_read"]
    assert agent("id: x\nmodel: {provider: scripted}\ntools: []\n").tools.names == []
    assert agent("id: x\nmodel: {provider: scripted}\n").pinned.tools == []
    listed = agent("id: x\nmodel: {provider: scripted}\ntools: [artifact_read, calculator]\n")
    assert listed.tools.names == ["artifact_read", "calculator"]


def test_the_configuration_block_is_pinned_after_the_instructions() -> None:
    built = agent(
        "id: x\nname: Helper\nmodel: {provider: scripted, context_window: 64000}\n"
        "instructions:\n  - Be brief.\n  - {label: policy, text: Never guess.}\n"
        "tools: [calculator]\n"
    )
    labels = [b.label for b in built.pinned.system]
    assert labels == ["instructions", "policy", "configuration"]
    assert all(b.pinned for b in built.pinned.system)
    configuration = built.pinned.system[2].text
    assert "agent 'x' (Helper)" in configuration
    assert "context window 64000 tokens" in configuration
    assert "Tools: calculator, artifact_read." in configuration
    assert "artifact_read returns one whole" in configuration
    bare = agent("id: x\nmodel: {provider: scripted}\ntools: []\n")
    assert [b.label for b in bare.pinned.system] == ["configuration"]
    assert "Tools: none." in bare.pinned.system[0].text
    assert "artifact_read" not in bare.pinned.system[0].text


def test_reminders_are_one_pinned_block_after_the_configuration() -> None:
    built = agent(
        "id: x\nmodel: {provider: scripted}\ninstructions: [Be brief.]\n"
        "reminders:\n  - Never promise what a tool did not confirm.\n  - Answer in English.\n"
    )
    assert [b.label for b in built.pinned.system] == ["instructions", "configuration",
                                                      "reminders"]  # fmt: skip
    assert built.pinned.system[-1].text == (
        "Never promise what a tool did not confirm.\nAnswer in English."
    )
    plain = agent("id: x\nmodel: {provider: scripted}\ninstructions: [Be brief.]\n")
    assert "reminders" not in [b.label for b in plain.pinned.system]


def test_the_pinned_blocks_are_rendered_once_per_build() -> None:
    text = "id: x\nmodel: {provider: scripted}\ntools: [calculator]\nreminders: [Be kind.]\n"
    first, second = agent(text), agent(text)
    assert first.pinned.system == second.pinned.system
    assert first.pinned.tools == second.pinned.tools


@pytest.mark.asyncio
async def test_a_scripted_compactor_writes_digests_with_a_model() -> None:
    built = agent(
        "id: x\nmodel: {provider: scripted}\n"
        "context: {compactor: {provider: scripted, id: small-model, max_output_tokens: 512}}\n"
    )
    digester = built.digester
    assert digester.model is not None and digester.model.label == "scripted (offline)"
    assert (digester.model_id, digester.max_tokens) == ("small-model", 512)
    text, source, fallback = await digester(None, covered())
    assert (source, fallback) == ("model", None)
    assert "Person: Find order 42" in text  # the scripted model echoes what it was given
    assert "Assistant calls lookup" in text


@pytest.mark.asyncio
async def test_without_a_compactor_digests_are_mechanical() -> None:
    digester = agent("id: x\nmodel: {provider: scripted}\n").digester
    assert digester.model is None
    text, source, fallback = await digester(None, covered())
    assert (source, fallback) == ("mechanical", None)
    assert text.startswith("1 turns are summarised here without a model.")


def test_an_anthropic_compactor_needs_its_key() -> None:
    error = refused(
        "id: x\nmodel: {provider: scripted}\ncontext: {compactor: {provider: anthropic}}\n"
    )
    assert error.field == "context.compactor.provider"


@pytest.mark.asyncio
async def test_an_anthropic_compactor_falls_back_to_a_mechanical_digest_when_it_fails(
    fake_anthropic: FakeAnthropic,
) -> None:
    built = agent(
        "id: x\nmodel: {provider: scripted}\n"
        "context:\n  compactor: {provider: anthropic, id: claude-haiku-5, max_retries: 0,\n"
        f"    base_url: '{fake_anthropic.url}'}}\n",
        env={"ANTHROPIC_API_KEY": "sk-test"},
    )
    digester = built.digester
    assert digester.model is not None
    try:
        fake_anthropic.script(Reply(text="  Order 42 shipped; nothing open.  "))
        assert await digester(None, covered()) == ("Order 42 shipped; nothing open.", "model",
                                                   None)  # fmt: skip
        sent = fake_anthropic.message_requests()[-1].body
        assert sent["model"] == "claude-haiku-5"
        assert sent["system"][0]["text"] == DIGEST_INSTRUCTION
        fake_anthropic.script(HttpError(400, "invalid_request_error", "no such model"))
        text, source, fallback = await digester(None, covered())
        assert source == "mechanical"
        assert text.startswith("1 turns are summarised here without a model.")
        assert fallback is not None and "no such model" in fallback
        fake_anthropic.script(Reply(text="   "))
        _, source, fallback = await digester(None, covered())
        assert (source, fallback) == ("mechanical", "the compactor replied nothing")
    finally:
        await digester.model.aclose()
