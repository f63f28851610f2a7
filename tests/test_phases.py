"""Phases (issue 36, part 1): only the current phase's tools reach the model; ``phase_set``
(offered when more than one phase is declared) changes them on the turn's next step, with a
``phase.changed`` on the log; the phase survives a restart, shows in the session resource and
the context view, and ``POST …/sessions/{key}/phase`` moves it (``400 phase_invalid`` for a
phase the agent does not declare). A manifest whose allow entry names no tool fails the load.
The model is the suite's fake Anthropic server, which records what each request offered."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from actors import phases as phasing
from actors.cluster.partitions import partition_of
from actors.tools import BUILTINS
from eventstore import streams
from eventstore.catalogue import PhaseChanged, SessionCleared, ToolRepair, ToolResult
from gateways.manifests import ManifestError
from runtime.manifest import build, decode
from runtime.manifest_v1 import translate
from tests import fakes
from tests.conftest import ApiFactory, ApiServer
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.turns import send, wait_end

fake_anthropic = fakes.fake_anthropic
Json = dict[str, Any]

PHASED = """
id: phased
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {url}
  api_key_env: DISPACH_TEST_ANTHROPIC_KEY
tools:
  - current_time
  - {{name: calculator, tags: [math]}}
  - session_notes
phases:
  triage: {{entry: true, allow: [current_time, session_notes]}}
  act: {{allow: ["tag:math", session_notes]}}
"""


def offered(request: Any) -> list[str]:
    return [t["name"] for t in request.body.get("tools", [])]


async def start(api_factory: ApiFactory, fake: FakeAnthropic, mp: pytest.MonkeyPatch) -> ApiServer:
    mp.setenv("DISPACH_TEST_ANTHROPIC_KEY", "test-key")
    api_factory.write_agent("phased", PHASED.format(url=fake.url))
    return await api_factory.start()


@pytest.mark.asyncio
async def test_phase_set_changes_the_tools_on_the_next_step_and_survives_a_restart(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("phase_set", {"phase": "act"}, id="toolu_phase")]),
        Reply(tool_uses=[ToolUse("calculator", {"expression": "6*7"}, id="toolu_calc")]),
        Reply(text="42."),
    )
    api = await start(api_factory, fake_anthropic, monkeypatch)
    accepted = await send(api.node, "phased", "what is 6*7?", session="api:p")
    events = await wait_end(api.node, accepted.turn_id)
    assert events[-1].data.reason == "final"  # type: ignore[union-attr]
    first, second, third = fake_anthropic.take_requests()
    # Entry phase: its own tools and phase_set, never the calculator; artifact_read is the
    # agent's (compaction names it) but in no phase's allow list, so it is not offered.
    assert offered(first) == ["session_notes", "current_time", "phase_set"]
    assert offered(second) == offered(third) == ["session_notes", "calculator", "phase_set"]
    # The shared tool carries the breakpoint: a phase change keeps it cached.
    assert first.body["tools"][0]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in first.body["tools"][1]
    (changed,) = [e.data for e in events if isinstance(e.data, PhaseChanged)]
    assert (changed.from_, changed.to, changed.by, changed.tools) == ("triage", "act", "tool", 3)
    results = [e.data for e in events if isinstance(e.data, ToolResult)]
    assert [(r.slug, r.ok) for r in results] == [("phase_set", True), ("calculator", True)]

    async with httpx.AsyncClient(base_url=api.url) as client:
        session = (await client.get("/v1/agents/phased/sessions/api:p")).json()
        assert session["phase"] == "act"
    await api.stop()
    await api_factory.nodes.started.pop().stop()

    fake_anthropic.script(Reply(text="Still acting."))
    api = await api_factory.start()
    accepted = await send(api.node, "phased", "and now?", session="api:p")
    await wait_end(api.node, accepted.turn_id)
    (after_restart,) = fake_anthropic.take_requests()
    assert offered(after_restart) == ["session_notes", "calculator", "phase_set"]
    async with httpx.AsyncClient(base_url=api.url) as client:
        context = (await client.get("/v1/agents/phased/context?sessionKey=api:p")).json()
        assert (context["phase"], context["tools"]) == (
            "act",
            ["session_notes", "calculator", "phase_set"],
        )
        replayed = (await client.get(f"/v1/agents/phased/turns/{accepted.turn_id}/context")).json()
        assert [t["name"] for t in replayed["steps"][0]["tools"]] == offered(after_restart)


@pytest.mark.asyncio
async def test_a_tool_outside_the_phase_is_refused_as_unknown(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("calculator", {"expression": "1+1"}, id="toolu_hidden")]),
        Reply(text="I cannot compute here."),
    )
    api = await start(api_factory, fake_anthropic, monkeypatch)
    accepted = await send(api.node, "phased", "1+1?", session="api:hidden")
    events = await wait_end(api.node, accepted.turn_id)
    # An unknown tool is invalid input: the model is told (a repair), the call never runs.
    assert [e.data for e in events if isinstance(e.data, ToolRepair)]
    assert not [e.data for e in events if isinstance(e.data, ToolResult) and e.data.ok]
    _, second = fake_anthropic.take_requests()
    assert "calculator" not in offered(second)


@pytest.mark.asyncio
async def test_the_route_moves_the_phase_and_refuses_an_undeclared_one(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = await start(api_factory, fake_anthropic, monkeypatch)
    base = "/v1/agents/phased/sessions/api:r"
    async with httpx.AsyncClient(base_url=api.url) as client:
        bad = await client.post(base + "/phase", json={"phase": "review"})
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert (error["code"], error["field"]) == ("phase_invalid", "phase")
        assert "triage, act" in error["hint"]
        wrong_type = await client.post(base + "/phase", json={"phase": 7})
        assert wrong_type.json()["error"]["code"] == "phase_invalid"

        moved = await client.post(base + "/phase", json={"phase": "act"})
        assert moved.status_code == 200 and moved.json() == {"phase": "act", "tools": 3}
        assert (await client.get(base)).json()["phase"] == "act"
        fake_anthropic.script(Reply(text="Acting."))
        accepted = await send(api.node, "phased", "go", session="api:r")
        await wait_end(api.node, accepted.turn_id)
        (request,) = fake_anthropic.take_requests()
        assert offered(request) == ["session_notes", "calculator", "phase_set"]

        back = await client.post(base + "/phase", json={"phase": None})
        assert back.json() == {"phase": "triage", "tools": 3}
        assert (await client.get(base)).json()["phase"] == "triage"

        await client.post(base + "/phase", json={"phase": "act"})
        cleared = (await client.delete(base)).json()
        assert cleared["memoryFilesKept"] is True and "phase" in cleared["reset"]
        assert (await client.get(base)).json()["phase"] == "triage"

        unphased = await client.post("/v1/agents/assistant/sessions/x/phase", json={"phase": "a"})
        assert unphased.status_code == 400
        assert "declares no phases" in unphased.json()["error"]["message"]


@pytest.mark.asyncio
async def test_the_context_without_a_session_is_a_new_sessions(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = await start(api_factory, fake_anthropic, monkeypatch)
    async with httpx.AsyncClient(base_url=api.url) as client:
        fresh = (await client.get("/v1/agents/phased/context")).json()
        assert fresh["sessionKey"] is None and fresh["phase"] == "triage"
        assert fresh["tools"] == ["session_notes", "current_time", "phase_set"]
        assert fresh["history"]["messages"] == 0
        labels = [s["label"] for s in fresh["slots"]]
        assert labels[0] == "tools" and "input" not in labels
        assert fresh["breakpoints"] == 2  # after the shared tools, after the system blocks
        described = (await client.get("/v1/agents/phased")).json()
        assert described["entryPhase"] == "triage"
        assert described["phases"] == {"triage": 3, "act": 3}


# --- the load, pure -----------------------------------------------------------------------------


def load(text: str) -> Any:
    return build(decode(text, "test.yaml"), {"DISPACH_TEST_ANTHROPIC_KEY": "k"})


def test_an_allow_entry_naming_no_tool_fails_the_load() -> None:
    bad = PHASED.format(url="http://127.0.0.1:9").replace("tag:math", "tag:write")
    with pytest.raises(ManifestError) as caught:
        load(bad)
    assert caught.value.code == "phase_allow_unmatched"
    assert caught.value.field == "phases.act.allow"
    assert "phases.act.allow: tag:write" in caught.value.message
    assert "calculator" in caught.value.hint


def test_one_phase_filters_without_phase_set_and_two_entries_are_refused() -> None:
    one = load("""
id: one
model: {provider: scripted}
tools: [current_time, calculator]
phases:
  only: {allow: [calculator]}
""")
    view = one.view(None)
    assert [t["name"] for t in view.pinned.tools] == ["calculator"]
    assert view.tools.get("phase_set") is None and view.tools.get("current_time") is None
    with pytest.raises(ManifestError, match="all marked entry"):
        load("""
id: two
model: {provider: scripted}
tools: [calculator]
phases:
  a: {entry: true, allow: ["*"]}
  b: {entry: true, allow: ["*"]}
""")


def test_the_fold_and_the_entry_phase() -> None:
    declared = [phasing.Declared("a", ("*",)), phasing.Declared("b", ("x",), entry=True)]
    assert phasing.entry_of(declared) == "b"
    assert phasing.entry_of(declared[:1]) == "a"
    phase = None
    for event, expected in [
        (PhaseChanged(to="a"), "a"),
        (PhaseChanged(to="b", from_="a"), "b"),
        (SessionCleared(), None),
    ]:
        phase = phasing.evolve(phase, event)
        assert phase == expected
    spec = BUILTINS["calculator"]()
    tagged = type(spec)(**{**spec.__dict__, "tags": ("Math",)})
    assert phasing.matches("tag:math", tagged) and phasing.matches("*", spec)
    assert not phasing.matches("tag:math", spec) and phasing.matches("calculator", spec)


def test_a_v1_manifest_carries_its_phases() -> None:
    ours, notes = translate({
        "apiVersion": "dispach/v1", "id": "v1p",
        "model": {"main": {"id": "m", "baseUrl": "http://127.0.0.1:9"}},
        "tools": {"local": ["now", "memory_write"]},
        "phases": {"triage": {"entry": True, "allow": ["now"]},
                   "act": {"allow": ["*", "memory_write", "tag:write"]}},
    })  # fmt: skip
    assert ours["phases"] == {"triage": {"allow": ["current_time"], "entry": True},
                              "act": {"allow": ["*"]}}  # fmt: skip
    assert "phases.act.allow: memory_write is not a tool carried over" in notes
    assert not any(n.startswith("phases:") for n in notes)


@pytest.mark.asyncio
async def test_the_route_goes_through_the_sessions_owner_fenced_and_in_order(
    api_factory: ApiFactory, fake_anthropic: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asked of a node that does not own the session's partition, the phase change is the
    owner's append (under its epoch, after the session's other events), not the asked node's
    unfenced one (which the store refuses once the partition is fenced)."""
    one = await start(api_factory, fake_anthropic, monkeypatch)
    two = await api_factory.start()
    own_one, own_two = one.node.ownership, two.node.ownership
    assert own_one is not None and own_two is not None

    async def settled() -> bool:
        serving = any(own_two.owns(p) for p in range(own_two.count))
        return serving and not set(own_one.epochs) & set(own_two.epochs)

    for _ in range(200):
        if await settled():
            break
        await asyncio.sleep(0.05)
    assert await settled(), "the two nodes did not share the partitions"
    key = next(k for k in (f"api:owned-{i}" for i in range(1000))
               if own_two.owns(partition_of("phased", k, own_two.count)))  # fmt: skip
    fake_anthropic.script(Reply(text="First."))
    first = await send(two.node, "phased", "hello", session=key)
    await wait_end(two.node, first.turn_id)

    base = f"/v1/agents/phased/sessions/{key}"
    async with httpx.AsyncClient(base_url=one.url) as client:
        moved = await client.post(base + "/phase", json={"phase": "act"})
        assert moved.status_code == 200, moved.text
        assert moved.json() == {"phase": "act", "tools": 3}
    store = two.node.store
    assert store is not None
    recorded = await store.aread_stream(streams.session("phased", key))
    [changed] = [e for e in recorded if e.type == "phase.changed"]
    assert changed.data.by == "api" and changed.data.to == "act"  # type: ignore[union-attr]
    fake_anthropic.script(Reply(text="Acting."))
    second = await send(two.node, "phased", "go", session=key)
    await wait_end(two.node, second.turn_id)
    *_, request = fake_anthropic.take_requests()
    assert offered(request) == ["session_notes", "calculator", "phase_set"]
