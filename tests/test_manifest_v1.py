"""Manifests of the original Dispach (``apiVersion: dispach/v1``) translated into ours: what is
carried over, what is noted as not carried, and that the result loads as one of our agents."""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import pytest

from runtime.manifest import Manifest, build
from runtime.manifest_v1 import V1ManifestError, is_v1, translate

MAIN = {"id": "qwen3-8b-instruct", "baseUrl": "http://127.0.0.1:8000/v1",
        "apiKeyEnv": "MODEL_API_KEY", "maxTokens": 2048}  # fmt: skip


def v1(**fields: Any) -> dict[str, Any]:
    """A manifest in the original's form: the required fields and ``fields``."""
    manifest: dict[str, Any] = {
        "apiVersion": "dispach/v1",
        "id": "helper",
        "model": {"main": dict(MAIN)},
        "context": {"window": 32768},
    }
    manifest.update(fields)
    return manifest


OURS_MAIN = {
    "provider": "openai",
    "id": "qwen3-8b-instruct",
    "base_url": "http://127.0.0.1:8000/v1",
    "api_key_env": "MODEL_API_KEY",
    "context_window": 32768,
    "max_output_tokens": 2048,
}


def test_the_smallest_manifest_of_the_original() -> None:
    raw = {
        "apiVersion": "dispach/v1",
        "id": "minimal",
        "name": "Vela (Minimal Assistant)",
        "model": {"main": {"id": "gpt-5-mini", "baseUrl": "https://api.openai.com/v1",
                           "apiKeyEnv": "MODEL_API_KEY", "temperature": 0.3}},
        "context": {"workspace": ".", "static": ["SOUL.md"], "reserveOutput": 8192},
        "limits": {"maxSteps": 4, "turnTimeoutMs": 120000},
    }  # fmt: skip
    ours, notes = translate(raw)
    assert ours == {
        "id": "minimal",
        "name": "Vela (Minimal Assistant)",
        "model": {"provider": "openai", "id": "gpt-5-mini", "base_url": "https://api.openai.com/v1",
                  "api_key_env": "MODEL_API_KEY", "reserve_output": 8192},
        "limits": {"max_steps": 4, "turn_timeout_s": 120.0, "untrusted_on_mutate": "deny"},
    }  # fmt: skip
    assert [n.split(":")[0] for n in notes] == [
        "context.window",
        "model.main.maxTokens",
        "model.main.temperature",
        "context.workspace",
        "context.static",
    ]
    assert all(len(n.splitlines()) == 1 and ": " in n for n in notes)


@pytest.mark.parametrize(
    ("role", "context", "expected", "noted"),
    [
        ({}, {"window": 32768}, OURS_MAIN, []),
        ({"reasoningEffort": "none"}, {"window": 32768},
         {**OURS_MAIN, "thinking": {"effort": "none"}}, []),
        ({"streamUsage": False}, {"window": 32768}, {**OURS_MAIN, "stream_usage": False}, []),
        ({"capabilities": {"contextWindow": 8192, "maxOutput": 1024}}, {},
         {**OURS_MAIN, "context_window": 8192}, []),
        ({"maxTokens": None, "capabilities": {"maxOutput": 1024}}, {"window": 32768},
         {**OURS_MAIN, "max_output_tokens": 1024}, []),
        ({"capabilities": {"contextWindow": 8192}}, {"window": 4096},
         {**OURS_MAIN, "context_window": 4096}, []),
        ({"apiKeyEnv": None}, {"window": 32768}, {**OURS_MAIN, "api_key_env": None}, []),
        ({"topP": 0.9, "headers": {"x-tenant": "a"}}, {"window": 32768}, OURS_MAIN,
         ["model.main.topP", "model.main.headers"]),
        ({"capabilities": {"nativeTools": False, "thinking": "deepseek"}}, {"window": 32768},
         OURS_MAIN, ["model.main.capabilities.nativeTools", "model.main.capabilities.thinking"]),
        ({"reserveOutput": 1}, {"window": 32768}, OURS_MAIN, ["model.main.reserveOutput"]),
        ({}, {"window": 32768, "reserveOutput": 6000},
         {**OURS_MAIN, "reserve_output": 6000}, []),
    ],
)  # fmt: skip
def test_the_main_role_becomes_our_openai_model(
    role: dict[str, Any], context: dict[str, Any], expected: dict[str, Any], noted: list[str]
) -> None:
    main = {**MAIN, **role}
    if main.get("maxTokens") is None:
        main.pop("maxTokens")
    if "apiKeyEnv" in role and role["apiKeyEnv"] is None:
        main.pop("apiKeyEnv")
        # No key variable in the original: ours sends no key either ("" is none).
        expected = {**expected, "api_key_env": ""}
    ours, notes = translate(v1(model={"main": main}, context=context))
    assert ours["model"] == expected
    assert [n.split(":")[0] for n in notes] == noted


def test_missing_window_and_output_limit_are_noted() -> None:
    main = {k: v for k, v in MAIN.items() if k != "maxTokens"}
    ours, notes = translate(v1(model={"main": main}, context={}))
    assert "context_window" not in ours["model"] and "max_output_tokens" not in ours["model"]
    assert notes[0].startswith("context.window: not given")
    assert "200000" in notes[0]
    assert notes[1].startswith("model.main.maxTokens: not given")


def test_the_compactor_role_writes_digests_and_refs_are_resolved() -> None:
    selector = {"id": "qwen3-1.7b-instruct", "baseUrl": "http://127.0.0.1:8001/v1"}
    model = {"main": MAIN, "selector": selector, "compactor": {"$ref": "model.selector"}}
    ours, notes = translate(v1(model=model))
    assert ours["context"] == {
        "compactor": {
            "provider": "openai",
            "id": "qwen3-1.7b-instruct",
            "base_url": "http://127.0.0.1:8001/v1",
            "api_key_env": "",
        }
    }
    assert [n.split(":")[0] for n in notes] == ["model.compactor.maxTokens", "model.selector"]


@pytest.mark.parametrize(
    ("raw", "field", "fragment"),
    [
        ({**v1(), "apiVersion": "dispach/v2"}, "apiVersion", "'dispach/v2'"),
        ({k: v for k, v in v1().items() if k != "apiVersion"}, "apiVersion", "None"),
        (v1(model={}), "model.main", "model.main is missing"),
        (v1(model={"main": {"$ref": "model.nowhere"}}), "model.main", "names nothing"),
        (v1(model={"main": {"$ref": "model.compactor"}, "compactor": {"$ref": "model.main"}}),
         "model.main", "refers to itself"),
        (v1(limits={"turnTimeoutMs": "ten minutes"}), "limits.turnTimeoutMs", "a number"),
        (v1(tools={"untrusted": {"onMutate": "sometimes"}}), "tools.untrusted.onMutate",
         "'sometimes'"),
        (v1(context=["window"]), "context", "a mapping"),
    ],
)  # fmt: skip
def test_what_cannot_be_read_is_refused(raw: dict[str, Any], field: str, fragment: str) -> None:
    with pytest.raises(V1ManifestError) as caught:
        translate(raw)
    assert caught.value.code == "invalid_manifest"
    assert caught.value.field == field and fragment in caught.value.message
    assert caught.value.hint


@pytest.mark.parametrize(
    ("limits", "context", "expected", "noted"),
    [
        ({}, {}, {}, []),
        ({"maxSteps": 12, "turnTimeoutMs": 1_800_000, "toolTimeoutMs": 120_000}, {},
         {"max_steps": 12, "turn_timeout_s": 1800.0, "tool_timeout_s": 120.0}, []),
        ({"toolTimeoutMs": 2500}, {}, {"tool_timeout_s": 2.5}, []),
        ({}, {"observationMaxTokens": 2000}, {"max_tool_output_chars": 7600}, []),
        ({}, {"observationMaxTokens": 10}, {"max_tool_output_chars": 200}, []),
        ({"maxParallelTools": 2, "noProgress": {"identicalCalls": 3}}, {}, {},
         ["limits.maxParallelTools", "limits.noProgress"]),
    ],
)  # fmt: skip
def test_limits_with_an_equivalent(
    limits: dict[str, Any], context: dict[str, Any], expected: dict[str, Any], noted: list[str]
) -> None:
    ours, notes = translate(v1(limits=limits, context={"window": 32768, **context}))
    assert ours["limits"] == {**expected, "untrusted_on_mutate": "deny"}
    assert [n.split(":")[0] for n in notes] == noted


@pytest.mark.parametrize(
    ("tools", "expected_tools", "on_mutate", "noted"),
    [
        ({}, None, "deny", []),
        ({"untrusted": {"onMutate": "confirm"}}, None, "ask", []),
        ({"untrusted": {"onMutate": "allow"}}, None, "allow", []),
        ({"local": ["now", "artifact_read", "memory_write"]}, ["current_time", "artifact_read"],
         "deny", ["tools.local"]),
        ({"local": ["now"], "policy": {"mode": "ask"}},
         [{"name": "current_time", "policy": "ask"}], "deny", []),
        ({"local": ["now", "artifact_read"], "policy": {"mode": "ask", "allow": ["now"],
                                                          "deny": ["artifact_read"]}},
         ["current_time", {"name": "artifact_read", "policy": "deny"}], "deny", []),
        ({"local": ["now"], "policy": {"deny": ["now", "exec(rm *)"], "allow": ["now"]}},
         [{"name": "current_time", "policy": "deny"}], "deny", ["tools.policy.deny"]),
        ({"dialect": "nlt", "pinned": ["exec", "GMAIL_SEND_EMAIL"], "providers": {"system": {}},
          "budget": {"max": 24}, "search": {"enabled": False}}, None, "deny",
         ["tools.dialect", "tools.pinned", "tools.providers", "tools.budget"]),
        ({"policy": {"onNoApprover": "deny"}}, None, "deny", ["tools.policy.onNoApprover"]),
    ],
)  # fmt: skip
def test_built_in_tools_their_policy_and_untrusted_output(
    tools: dict[str, Any], expected_tools: list[Any] | None, on_mutate: str, noted: list[str]
) -> None:
    ours, notes = translate(v1(tools=tools))
    assert ours.get("tools") == expected_tools
    assert ours["limits"]["untrusted_on_mutate"] == on_mutate
    assert [n.split(":")[0] for n in notes] == noted


def test_pinned_provider_tools_are_named_in_the_note() -> None:
    _, notes = translate(v1(tools={"pinned": ["exec", "GMAIL_SEND_EMAIL"]}))
    assert notes == ["tools.pinned: provider tools are not supported: exec, GMAIL_SEND_EMAIL"]


def test_telegram_channels_and_their_schedules_are_carried_over() -> None:
    channels = [
        {"type": "telegram", "id": "tg", "mode": "longpoll", "tokenEnv": "TELEGRAM_BOT_TOKEN",
         "allowFrom": ["@moeen"], "enabled": False, "webhookPath": "/hook"},
        {"type": "whatsapp", "id": "wa", "authDir": "./.dispach/wa-auth"},
    ]  # fmt: skip
    schedules = [
        {"id": "morning-brief", "kind": "cron", "expr": "0 8 * * *", "task": "Summarise.",
         "deliver": {"channel": "tg", "to": "12345"}, "session": "isolated",
         "timezone": "Asia/Dhaka"},
        {"id": "wa-ping", "kind": "every", "expr": "15m", "task": "Ping.",
         "deliver": {"channel": "wa", "to": "x"}},
        {"id": "quiet", "kind": "at", "expr": "2030-01-01T08:00:00Z", "task": "Hi.",
         "deliver": "none", "enabled": False},
    ]  # fmt: skip
    ours, notes = translate(v1(channels=channels, schedules=schedules))
    assert ours["channels"] == [
        {"type": "telegram", "id": "tg", "mode": "longpoll", "token_env": "TELEGRAM_BOT_TOKEN",
         "allow_from": ["@moeen"], "enabled": False},
    ]  # fmt: skip
    assert ours["schedules"] == [schedules[0], schedules[2]]
    assert [n.split(":")[0] for n in notes] == ["channels[0].webhookPath", "channels[1]",
                                                "schedules[1]"]  # fmt: skip


def test_sections_without_an_equivalent_are_noted() -> None:
    sections = {
        "extends": "./base.agent.yaml",
        "knowledge": {"dir": "./knowledge"},
        "memory": {},
        "delivery": {"default": "tg"},
        "plugins": ["@dispach/channel-telegram"],
        "server": {"enabled": True, "port": 7420},
        "kind": "Agent",
    }
    _, notes = translate(v1(**sections))
    assert [n.split(":")[0] for n in notes] == list(sections)
    assert notes[-1] == "kind: not a field of the v1 schema"


def test_skills_are_read_as_ours_less_the_score_floor() -> None:
    ours, notes = translate(v1(skills={"dir": "./skills", "maxActive": 2, "threshold": 0.35}))
    assert ours["skills"] == {"dir": "./skills", "max": 2}
    assert [n.split(":")[0] for n in notes] == ["skills.threshold"]


def test_context_fields_of_the_workspace_and_the_ladder_are_noted() -> None:
    context = {"window": 32768, "thresholds": {"trim": 0.6}, "budgets": {"static": 2000},
               "rules": {"onExceed": "warn"}, "compactionNotice": True, "reminder": "R.md",
               "soul": {"file": "SOUL.md"}, "volatile": ["USER.md"]}  # fmt: skip
    _, notes = translate(v1(context=context))
    assert [n.split(":")[0] for n in notes] == [f"context.{k}" for k in list(context)[1:]]


def test_environment_references_are_noted_not_expanded() -> None:
    main = {**MAIN, "id": "${MODEL_ID}", "baseUrl": "${MODEL_BASE_URL}"}
    ours, notes = translate(v1(model={"main": main}))
    assert ours["model"]["id"] == "${MODEL_ID}"
    assert notes == [
        "model.id: ${MODEL_ID} is not expanded here; expand it before translating or write the "
        "value",
        "model.base_url: ${MODEL_BASE_URL} is not expanded here; expand it before translating "
        "or write the value",
    ]


def test_translate_leaves_its_input_alone() -> None:
    raw = v1(model={"main": MAIN, "compactor": {"$ref": "model.main"}})
    before = copy.deepcopy(raw)
    translate(raw)
    assert raw == before
    assert is_v1(raw) and not is_v1({"id": "helper"})


def test_a_full_manifest_loads_as_one_of_our_agents() -> None:
    raw = v1(
        name="Milo",
        model={"main": {**MAIN, "reasoningEffort": "low"}, "compactor": {"$ref": "model.main"}},
        context={"window": 32768, "reserveOutput": 4096, "observationMaxTokens": 1000},
        tools={"local": ["now", "artifact_read"], "untrusted": {"onMutate": "confirm"}},
        limits={"maxSteps": 6, "turnTimeoutMs": 300000, "toolTimeoutMs": 30000},
        channels=[{"type": "telegram", "id": "tg", "tokenEnv": "TG_TOKEN", "allowFrom": ["*"]}],
        schedules=[{"id": "daily", "kind": "cron", "expr": "0 9 * * *", "task": "Report.",
                    "deliver": {"channel": "tg", "to": "42"}}],
    )  # fmt: skip
    ours, _ = translate(raw)
    manifest = msgspec.convert(ours, Manifest)
    agent = build(manifest, {"MODEL_API_KEY": "sk-test", "TG_TOKEN": "123:abc"})
    assert agent.model.label == "openai:qwen3-8b-instruct"
    assert agent.name == "Milo"
    assert agent.tools.names == ["current_time", "artifact_read"]
    assert (agent.limits.max_steps, agent.limits.turn_timeout_s) == (6, 300.0)
    assert agent.limits.tool_timeout_s == 30.0
    assert agent.limits.max_tool_output_chars == 3800
    assert agent.limits.untrusted_on_mutate == "ask"
    assert agent.context.window == 32768 and agent.context.reserve_output == 4096
    assert agent.reasoning is not None and agent.reasoning.effort == "low"
    assert agent.digester.model is not None
    assert sorted(agent.channels) == ["tg"] and [s.id for s in agent.schedules] == ["daily"]
