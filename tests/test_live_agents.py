"""Live agents (issue 36 part 4): ``POST /v1/agents/{agent}/reload``, ``/stop`` and ``/start`` on
a cluster of two real nodes (in process, on the test's Postgres and NATS, each behind its own
HTTP server), asked of one node and taking effect on both.

The agent's model is the offline scripted one, told apart by version: each manifest's script
replies with its version's words, and every ``model.call`` names the version that made it
(``agentVersion``, the manifest's content hash); a message starting
with "slow" calls a tool that runs for a while first, so turns are running when the reload
comes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import pytest_asyncio

from eventstore import streams, subjects
from eventstore.catalogue import AgentReloaded, AgentStarted, AgentStopped, ScheduleSkipped
from eventstore.envelope import START
from runtime.manifest import version_of
from tests.conftest import ApiFactory, ApiServer
from tests.test_api_http import client_of, ended, error_of, post
from tests.test_api_streams import opened, receive, send
from tests.test_cli_admin import refused_with
from tests.test_client import dispach

Json = dict[str, Any]
AGENT = "live"


def manifest(version: str, path: Path, seconds: float = 2.0) -> str:
    return f"""
id: {AGENT}
model:
  provider: scripted
  id: model-{version}
  script:
    - {{match: "^slow", tool: wait, input: {{path: "{path}", seconds: {seconds}}}}}
    - {{match: ".*", reply: "{version} says {{0}}"}}
tools:
  - name: wait
    module: tests.fixtures_tools:record_call
    description: Waits a while.
    input_schema: {{type: object}}
"""


async def until(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool], what: str, timeout: float = 10.0
) -> float:
    """Seconds until ``check`` holds (polled every 50 ms); fails naming ``what``."""
    started = time.monotonic()
    while True:
        held = check()
        if held if isinstance(held, bool) else await held:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


Clients = Callable[[ApiServer], httpx.AsyncClient]


@pytest_asyncio.fixture
async def clients() -> AsyncIterator[Clients]:
    """An HTTP client per node, closed after the test (one each: making one costs the loop)."""
    made: list[httpx.AsyncClient] = []

    def of(api: ApiServer) -> httpx.AsyncClient:
        made.append(client_of(api))
        return made[-1]

    yield of
    for client in made:
        await client.aclose()


def ran(path: Path) -> int:
    """How many calls of the slow tool started (one line each)."""
    return len(path.read_text().splitlines()) if path.exists() else 0


async def agent_of(http: httpx.AsyncClient) -> Json:
    response = await http.get(f"/v1/agents/{AGENT}")
    assert response.status_code == 200, response.text
    found: Json = response.json()
    return found


async def change(http: httpx.AsyncClient, kind: str, **body: Any) -> httpx.Response:
    return await http.post(f"/v1/agents/{AGENT}/{kind}", json=body or None)


async def model_calls(http: httpx.AsyncClient, turn_id: str) -> list[Json]:
    response = await http.get(f"/v1/agents/{AGENT}/turns/{turn_id}/events")
    assert response.status_code == 200, response.text
    return [e["data"] for e in response.json()["events"] if e["type"] == "model.call"]


async def agent_stream(api: ApiServer) -> list[Any]:
    store = api.node.store
    assert store is not None
    return [e.data for e in await store.aread_stream(streams.agent(AGENT))]


async def accepted(http: httpx.AsyncClient, text: str, session: str) -> str:
    response = await post(http, text, agent=AGENT, sessionKey=session)
    assert response.status_code == 202, response.text
    turn_id: str = response.json()["turnId"]
    return turn_id


async def final_text(http: httpx.AsyncClient, turn_id: str) -> str:
    turn = await ended(http, turn_id, AGENT)
    assert turn["status"] == "final", turn
    text: str = turn["text"]
    return text


# --- reload ------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_reload_under_load_changes_the_model_for_new_turns_only_on_every_node(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    runs = tmp_path / "runs.txt"
    v1, v2 = manifest("v1", runs), manifest("v2", runs)
    api_factory.write_agent(AGENT, v1)
    one, two = await api_factory.start(), await api_factory.start()
    old, new = version_of(v1.encode()), version_of(v2.encode())
    async with client_of(one) as h1, client_of(two) as h2:
        assert (await agent_of(h1))["version"] == (await agent_of(h2))["version"] == old

        # Six turns, three per node, each in its tool when the reload comes.
        slow = [await accepted((h1, h2)[i % 2], f"slow {i}", f"slow-{i}") for i in range(6)]

        await until(lambda: ran(runs) == len(slow), "the six slow turns to be in their tool")
        api_factory.write_agent(AGENT, v2)
        reloaded = await change(h1, "reload", by="tester")
        assert reloaded.status_code == 200, reloaded.text
        state = reloaded.json()
        assert state["id"] == AGENT and state["status"] == "loaded" and state["changed"] is True
        assert state["version"] == new and state["previousVersion"] == old
        assert "warnings" not in state and state["reloadedAt"]  # nothing it could not change
        took = await until(
            lambda: _is(agent_of(h2), "version", new), "the other node to run the new version", 5
        )
        assert took < 2.5, f"the other node took {took:.2f} s"

        # New turns on both nodes run the new version; the turns that were running finish on theirs.
        fresh = [await accepted((h1, h2)[i % 2], f"hello {i}", f"new-{i}") for i in range(4)]
        for i, turn_id in enumerate(fresh):
            assert (
                await final_text((h1, h2)[i % 2], turn_id)
                == f"[scripted model, offline] v2 says hello {i}"
            )
            assert [c["agentVersion"] for c in await model_calls(h1, turn_id)] == [new]
        for turn_id in slow:
            assert "The tools answered" in await final_text(h1, turn_id)
            calls = await model_calls(h2, turn_id)
            assert [c["agentVersion"] for c in calls] == [old, old], calls

        # On the record: who asked, which node read it, the text every node built.
        recorded = await agent_stream(two)
        assert len(recorded) == 1 and isinstance(recorded[0], AgentReloaded)
        event = recorded[0]
        assert (event.version, event.previous, event.by) == (new, old, "tester")
        assert event.node == one.node.node_id and event.manifest == v2

        # On the public firehose the reload is there without the manifest's text.
        query = {"agentId": AGENT, "types": "agent.reloaded", "after": START.cursor()}
        async with h2.stream("GET", "/v1/events", params=query) as stream:
            async for line in stream.aiter_lines():
                frame = msgspec.json.decode(line[5:]) if line.startswith("data:") else {}
                if frame.get("type") == "agent.reloaded":
                    assert frame["data"]["version"] == new and "manifest" not in frame["data"]
                    break


async def _is(detail: Awaitable[Json], field: str, value: object) -> bool:
    return (await detail).get(field) == value


@pytest.mark.asyncio
async def test_a_broken_manifest_is_refused_with_its_error_and_changes_nothing(
    api_factory: ApiFactory, tmp_path: Path, clients: Clients
) -> None:
    v1 = manifest("v1", tmp_path / "runs.txt")
    api_factory.write_agent(AGENT, v1)
    api = await api_factory.start()
    http = clients(api)
    broken = {
        "not YAML": ("id: live\nmodel: [", None),
        "a field of the wrong type": (
            v1.replace("input_schema: {type: object}", "input_schema: 5"),
            "tools",
        ),
        "another id": (v1.replace(f"id: {AGENT}", "id: other"), "id"),
    }
    for what, (text, field) in broken.items():
        api_factory.write_agent(AGENT, text)
        refused = await change(http, "reload")
        error = error_of(refused, 400, "invalid_manifest")
        assert field is None or (error.get("field") or "").startswith(field), (what, error)
    assert (await agent_of(http))["version"] == version_of(v1.encode())
    assert await agent_stream(api) == []
    assert await final_text(http, await accepted(http, "hi", "after")) == (
        "[scripted model, offline] v1 says hi"
    )
    nobody = await http.post("/v1/agents/nobody/reload")
    bad_body = await http.post(f"/v1/agents/{AGENT}/reload", json={"by": "has spaces"})
    error_of(nobody, 404, "agent_not_found")
    error_of(bad_body, 400, "request_body_invalid")


# --- stop and start ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_stopped_agent_is_refused_on_every_door_of_every_node_until_started(
    api_factory: ApiFactory, tmp_path: Path, clients: Clients
) -> None:
    runs = tmp_path / "runs.txt"
    api_factory.write_agent(AGENT, manifest("v1", runs, seconds=1.5))
    one, two = await api_factory.start(), await api_factory.start()
    h1, h2 = clients(one), clients(two)
    running = await accepted(h1, "slow", "running")
    await until(lambda: ran(runs) == 1, "the running turn to be in its tool")

    stopped = await change(h1, "stop", reason="maintenance")
    assert stopped.status_code == 200, stopped.text
    state = stopped.json()
    assert state["status"] == "disabled" and state["changed"] is True
    assert state["reason"] == "maintenance" and state["disabledBy"] == "api"
    assert state["disabledAt"]
    again = (await change(h2, "stop", reason="again")).json()
    assert again["changed"] is False and again["reason"] == "maintenance"  # the first stands

    await until(lambda: _is(agent_of(h2), "status", "disabled"), "the other node to fold it", 5)
    # HTTP, on the node that was not asked.
    listed = {a["id"]: a for a in (await h2.get("/v1/agents")).json()}
    refused = await post(h2, "hello", agent=AGENT, sessionKey="s")
    assert listed[AGENT]["status"] == "disabled" and listed[AGENT]["reason"] == "maintenance"
    error = error_of(refused, 409, "agent_stopped")
    assert "disabled" in error["message"] and "maintenance" in error["message"]
    assert f"/v1/agents/{AGENT}/start" in error["hint"]
    # The WebSocket and the NATS ingress.
    async with opened(two) as ws:
        await send(ws, type="message", agentId=AGENT, text="hello", ref="r")
        frame = await receive(ws)
    assert frame["type"] == "ws.error" and frame["code"] == "agent_stopped", frame
    nc = two.node.nc
    assert nc is not None
    answer = await nc.request(subjects.ingress(AGENT), b'{"text": "hello"}', timeout=10)
    assert msgspec.json.decode(answer.data)["error"]["code"] == "agent_stopped"
    # A schedule's ticks are recorded as skipped, never fired.
    tick = {"id": "tick", "kind": "every", "expr": "1s", "task": "ping", "deliver": "none"}
    defined = await h1.post(f"/v1/agents/{AGENT}/schedules", json=tick)
    assert defined.status_code == 201, defined.text
    store = one.node.store
    assert store is not None

    async def schedule() -> list[Any]:
        return [e.data for e in await store.aread_stream(streams.schedule(AGENT, "tick"))]

    async def skipped() -> bool:
        return any(isinstance(e, ScheduleSkipped) and e.reason == "agent_stopped"
                   for e in await schedule())  # fmt: skip

    await until(skipped, "a tick skipped while stopped")
    assert [type(e).__name__ for e in await schedule()].count("ScheduleFired") == 0
    # The turn that was running when the stop came ran to its end.
    assert "The tools answered" in await final_text(h1, running)

    # A node started now folds the stop from the log: still refused.
    await two.stop()
    await two.node.stop()
    api_factory.started.remove(two)
    api_factory.nodes.started.remove(two.node)
    three = await api_factory.start()
    h3 = clients(three)
    assert (await agent_of(h3))["status"] == "disabled"
    error_of(await post(h3, "hello", agent=AGENT, sessionKey="s"), 409, "agent_stopped")

    started = await change(h3, "start", by="cli")
    assert started.status_code == 200, started.text
    assert started.json()["status"] == "loaded" and started.json()["changed"] is True
    await until(lambda: _is(agent_of(h1), "status", "loaded"), "the first node to fold it", 5)
    assert await final_text(h1, await accepted(h1, "hello", "s")) == (
        "[scripted model, offline] v1 says hello"
    )
    assert [type(e) for e in await agent_stream(one)] == [AgentStopped, AgentStarted]
    assert (await agent_stream(one))[1].by == "cli"


# --- the CLI -----------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_cli_stops_reloads_and_starts_an_agent(
    api_factory: ApiFactory, tmp_path: Path, clients: Clients
) -> None:
    runs = tmp_path / "runs.txt"
    api_factory.write_agent(AGENT, manifest("v1", runs))
    api = await api_factory.start()
    http = clients(api)
    code, out, err = await dispach(api, "agents", "stop", AGENT, "--reason", "upgrade")
    assert code == 0, err
    assert (
        out.startswith(f"agent {AGENT} stopped: disabled, version sha256:") and "(upgrade)" in out
    )
    error_of(await post(http, "hi", agent=AGENT, sessionKey="s"), 409, "agent_stopped")

    v2 = manifest("v2", runs)
    api_factory.write_agent(AGENT, v2)
    code, out, err = await dispach(api, "agents", "reload", AGENT, "--json")
    assert code == 0, err
    state = json.loads(out)
    assert state["version"] == version_of(v2.encode()) and state["status"] == "disabled"
    api_factory.write_agent(AGENT, "id: live\nmodel: [")
    refused_with(await dispach(api, "agents", "reload", AGENT), "invalid_manifest")

    code, out, err = await dispach(api, "agents", "start", AGENT)
    assert code == 0 and out.startswith(f"agent {AGENT} started: loaded"), err
    assert await final_text(http, await accepted(http, "hi", "s")) == (
        "[scripted model, offline] v2 says hi"
    )
    recorded = await agent_stream(api)
    assert [(type(e), e.by) for e in recorded] == [
        (AgentStopped, "cli"), (AgentReloaded, "cli"), (AgentStarted, "cli")
    ]  # fmt: skip
