"""What a Dispach v1 client meets on our API beyond messages and streams: the tools and skills
of an agent (skills supported), reload (done: tests/test_live_agents.py) and a session's phase
(which must be declared), v1's own codes for a ``deliver`` or ``from`` that does not fit (on
every door: HTTP, WebSocket, NATS), the cleared session's ``memoryFilesKept``, the model an
agent really runs, the envelope's ``runtimeId``, and a turn's prompt tokens summed over its
model calls."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from eventstore import EventStore, Metadata, NewEvent, subjects
from eventstore.catalogue import ModelResult, TurnStart
from tests.conftest import ApiFactory, ApiServer, ConnectFactory
from tests.storeops import append
from tests.test_api_http import all_turns, client_of, ended, error_of, post
from tests.test_api_streams import kind, opened, read_sse, receive, receive_until, send

Json = dict[str, Any]

TOOLED = """
id: tooled
model: {provider: scripted}
tools:
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: "Records that it ran.\\nA second line the summary leaves out."
    mutating: true
    policy: ask
    timeout_s: 5
    input_schema: {type: object}
  - name: fetch
    module: tests.fixtures_tools:fetch_page
    description: Fetches a page.
    untrusted_output: true
    input_schema: {type: object}
  - {name: calculator, policy: deny}
limits: {tool_timeout_s: 12}
"""

HOSTED = """
id: hosted
model:
  provider: anthropic
  id: claude-haiku-5
  base_url: http://127.0.0.1:9
  api_key_env: DISPACH_TEST_GAPS_KEY
"""


# --- an agent's tools and skills ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_tools_of_an_agent_in_v1_shape_with_policy_and_timeout(
    api_factory: ApiFactory,
) -> None:
    api_factory.write_agent("tooled", TOOLED)
    api = await api_factory.start()
    async with client_of(api) as http:
        listed = await http.get("/v1/agents/tooled/tools")
        detail = await http.get("/v1/agents/tooled")
        nobody = await http.get("/v1/agents/nobody/tools")
    assert listed.status_code == 200, listed.text
    tools = {t["slug"]: t for t in listed.json()}
    assert [t["slug"] for t in listed.json()] == ["record", "fetch", "calculator", "artifact_read"]
    assert tools["record"] == {"slug": "record", "summary": "Records that it ran.",
                               "mutating": True, "trust": "trusted", "provider": "local",
                               "policy": "ask", "timeoutS": 5.0}  # fmt: skip
    assert tools["fetch"]["trust"] == "untrusted" and tools["fetch"]["policy"] == "allow"
    assert tools["fetch"]["timeoutS"] == 12.0  # the agent's limits.tool_timeout_s
    assert tools["calculator"]["policy"] == "deny" and not tools["calculator"]["mutating"]
    assert {t["provider"] for t in tools.values()} == {"local"}
    assert detail.json()["toolList"] == listed.json()
    assert detail.json()["tools"] == 4
    error_of(nobody, 404, "agent_not_found")


@pytest.mark.asyncio
async def test_skills_are_supported_and_an_agent_without_any_says_so(api: ApiServer) -> None:
    """v1 0.1.0 answered ``{skills: [], supported: false}``; skills exist here (tests/
    test_skills.py), so the default agent, which has none, answers an empty list, supported,
    with how its turns would select them."""
    async with client_of(api) as http:
        skills = await http.get("/v1/agents/assistant/skills")
        nobody = await http.get("/v1/agents/nobody/skills")
    assert skills.status_code == 200
    body = skills.json()
    assert (body["skills"], body["supported"]) == ([], True)
    assert body["selection"]["dir"] is None and body["selection"]["max"] == 1
    assert body["memory"]["recall"] is False
    error_of(nobody, 404, "agent_not_found")


@pytest.mark.asyncio
async def test_reload_is_done_and_a_phase_must_be_declared(api: ApiServer) -> None:
    async with client_of(api) as http:
        reload = await http.post("/v1/agents/assistant/reload")
        phase = await http.post("/v1/agents/assistant/sessions/s1/phase", json={"phase": "triage"})
        cleared = await http.post("/v1/agents/assistant/sessions/s1/phase", json={"phase": None})
        typed = await http.post("/v1/agents/assistant/sessions/s1/phase", json={"phase": ["a"]})
        not_json = await http.post(
            "/v1/agents/assistant/sessions/s1/phase",
            content=b"{phase",
            headers={"Content-Type": "application/json"},
        )
        sessions = await http.get("/v1/agents/assistant/sessions")
    # The default agent has no file: its built-in manifest is read again, the same version.
    assert reload.status_code == 200, reload.text
    reloaded = reload.json()
    assert reloaded["id"] == "assistant" and reloaded["status"] == "loaded"
    assert reloaded["changed"] is False and reloaded["version"] == reloaded["previousVersion"]
    assert reloaded["version"].startswith("sha256:")
    # The default agent declares no phases: no name is one of its phases, null included.
    for answer in (phase, cleared):
        assert "phases" in error_of(answer, 400, "phase_invalid")["hint"]
    assert error_of(typed, 400, "phase_invalid")["field"] == "phase"
    error_of(not_json, 400, "body_not_json")
    assert sessions.json() == []  # nothing was stored, no session was made


# --- `deliver` and `from` that do not fit: v1's codes, on every door ---------------------------

MISFITS: list[tuple[Json, str, str]] = [
    ({"deliver": "telegram"}, "deliver_invalid", "deliver"),
    ({"deliver": 5}, "deliver_invalid", "deliver"),
    ({"deliver": {"channel": 5, "to": "1"}}, "deliver_invalid", "deliver.channel"),
    ({"deliver": {"channel": "hooks"}}, "deliver_invalid", "deliver.to"),
    ({"from": "ada"}, "sender_invalid", "from"),
    ({"from": {"name": "Ada"}}, "sender_invalid", "from.id"),
    ({"from": {"id": "u1", "kind": "robot"}}, "sender_invalid", "from.kind"),
]
MISFIT_IDS = [f"{code}-{field}-{json.dumps(body)}" for body, code, field in MISFITS]


@pytest.mark.asyncio
@pytest.mark.parametrize(("body", "code", "field"), MISFITS, ids=MISFIT_IDS)
async def test_a_misfit_deliver_or_from_has_v1s_code_on_http(
    api: ApiServer, body: Json, code: str, field: str
) -> None:
    async with client_of(api) as http:
        response = await post(http, "hi", **body)
        assert await all_turns(http) == []
    error = error_of(response, 400, code)
    assert error["field"] == field and field in error["message"]


@pytest.mark.asyncio
async def test_a_misfit_deliver_or_from_has_v1s_code_on_the_websocket(api: ApiServer) -> None:
    got = []
    async with opened(api) as ws:
        for body, _, _ in MISFITS:
            await send(ws, type="message", agentId="assistant", text="hi", **body)
            got.append(await receive(ws))
        # A `from` that fits is taken, and the turn records who sent it.
        await send(ws, type="message", agentId="assistant", text="hi", ref="ok",
                   **{"from": {"id": "u-42", "name": "Ada"}})  # fmt: skip
        accepted = await receive(ws)
    assert [(f["type"], f["code"], f["field"]) for f in got] == [
        ("ws.error", code, field) for _, code, field in MISFITS
    ]
    assert all(f["message"] and f["hint"] for f in got)
    assert accepted["type"] == "ws.accepted", accepted
    async with client_of(api) as http:
        await ended(http, accepted["turnId"])
        events = (await http.get(f"/v1/agents/assistant/turns/{accepted['turnId']}/events")).json()
    start = events["events"][0]
    assert start["type"] == "turn.start" and start["data"]["source"] == "ws"
    assert start["data"]["sender"] == {"id": "u-42", "name": "Ada"}  # kind: user, the default


@pytest.mark.asyncio
async def test_a_misfit_deliver_or_from_has_v1s_code_on_nats(api: ApiServer) -> None:
    nc = api.node.nc
    assert nc is not None
    got = []
    for body, _, _ in MISFITS:
        raw = msgspec.json.encode({"text": "hi", **body})
        answer = await nc.request(subjects.ingress("assistant"), raw, timeout=10)
        got.append(msgspec.json.decode(answer.data)["error"])
    assert [(e["code"], e["field"]) for e in got] == [(code, field) for _, code, field in MISFITS]
    assert all(e["message"] and e["hint"] for e in got)


# --- the cleared session, the agent's model, the envelope ------------------------------------


@pytest.mark.asyncio
async def test_clearing_says_what_it_keeps_and_what_it_resets(api: ApiServer) -> None:
    async with client_of(api) as http:
        accepted = (await post(http, "hello", sessionKey="mem")).json()
        await ended(http, accepted["turnId"])
        cleared = await http.delete("/v1/agents/assistant/sessions/mem")
    assert cleared.status_code == 200
    # Nothing beyond the session is touched (v1's flag); the session itself starts afresh.
    assert cleared.json() == {"cleared": "mem", "memoryFilesKept": True,
                              "reset": ["history", "notes", "phase"]}  # fmt: skip


@pytest.mark.asyncio
async def test_an_agent_shows_the_model_it_really_runs(
    api_factory: ApiFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISPACH_TEST_GAPS_KEY", "test-key")
    api_factory.write_agent("hosted", HOSTED)
    api = await api_factory.start()
    async with client_of(api) as http:
        listed = {a["id"]: a for a in (await http.get("/v1/agents")).json()}
        offline = (await http.get("/v1/agents/assistant")).json()
    # The default agent names claude-sonnet-5 in its manifest but, without a key, runs offline.
    assert listed["assistant"]["model"] == offline["model"] == "scripted (offline)"
    assert listed["hosted"]["model"] == "claude-haiku-5"
    assert listed["hosted"]["provider"] == "anthropic:claude-haiku-5"


@pytest.mark.asyncio
async def test_every_envelope_names_the_node_that_serves_it(api: ApiServer) -> None:
    node = api.node.node_id
    async with client_of(api) as http:
        turn_id = (await post(http, "calculate 6*7")).json()["turnId"]
        await ended(http, turn_id)
        page = (await http.get(f"/v1/agents/assistant/turns/{turn_id}/events")).json()["events"]
        frames = await read_sse(http, f"/v1/agents/assistant/turns/{turn_id}/stream")
    async with opened(api) as ws:
        await send(ws, type="subscribe", turnId=turn_id)
        on_ws = await receive_until(ws, kind("stream.ended"))
    on_sse = [f.data for f in frames if f.id is not None]
    on_socket = [f for f in on_ws if "cursor" in f]
    assert page and on_sse and on_socket
    assert {e["runtimeId"] for e in page + on_sse + on_socket} == {node}
    assert [e["cursor"] for e in on_sse] == [e["cursor"] for e in on_socket]


# --- a turn's prompt tokens: summed over its model calls, as its other figures are ------------


def test_a_turns_prompt_tokens_are_the_sum_of_its_calls(
    store: EventStore, connect: ConnectFactory
) -> None:
    meta = Metadata(agent_id="a", session_key="api:default", turn_id="t_sum")
    calls = [(700, 30, 0), (900, 20, 650)]  # (prompt, output, cache read) of each model call
    append(store, "turn-t_sum", [
        NewEvent(event=TurnStart(source="api", input="hi"), metadata=meta),
        *(NewEvent(event=ModelResult(prompt_tokens=prompt, output_tokens=output,
                                     cache_read_tokens=read, finish_reason="tool_use",
                                     latency_ms=4), metadata=meta)
          for prompt, output, read in calls),
    ])  # fmt: skip
    with connect() as conn:
        row = conn.execute(
            "SELECT steps, prompt_tokens, output_tokens, cache_read_tokens FROM turns"
            " WHERE turn_id = 't_sum'"
        ).fetchone()
    assert row == (2, 1600, 50, 650)
