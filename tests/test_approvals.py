"""Tool policy and human approval: ``deny`` refuses, ``ask`` parks the turn (no task, no thread)
until a person answers over HTTP or WebSocket; the answer or its timeout lets the turn run on,
with the call or with a refusal the model reads; a restart does not lose the wait."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from eventstore.catalogue import ApprovalResolved, ToolGated, ToolResult
from tests import fakes
from tests.conftest import ApiFactory, ApiServer
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.turns import send, wait_end

fake_anthropic = fakes.fake_anthropic

CAREFUL = """
id: careful
model:
  provider: scripted
  script:
    - {{match: "^record (.+)$", tool: record, input: {{path: "{path}", seconds: 0}}}}
    - {{match: "^sum$", tool: calculator, input: {{expression: "2+2"}}}}
tools:
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran.
    mutating: true
    policy: ask
    input_schema: {{type: object, properties: {{path: {{type: string}}}}, required: [path]}}
  - {{name: calculator, policy: deny}}
limits: {{approval_timeout_s: {timeout}}}
"""


async def start(api_factory: ApiFactory, tmp_path: Path, timeout: float = 60) -> ApiServer:
    api_factory.write_agent("careful", CAREFUL.format(path=tmp_path / "ran.txt", timeout=timeout))
    return await api_factory.start()


async def pending(api: ApiServer, n: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=api.url) as client:
        for _ in range(int(timeout / 0.05)):
            listed: list[dict[str, Any]] = (
                await client.get("/v1/agents/careful/approvals")
            ).json()["approvals"]
            if len(listed) >= n:
                return listed
            await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {n} approvals pending")


async def turn(api: ApiServer, turn_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=api.url) as client:
        answer: dict[str, Any] = (await client.get(f"/v1/turns/{turn_id}")).json()
        return answer


def results(events: list[Any]) -> list[ToolResult]:
    return [e.data for e in events if isinstance(e.data, ToolResult)]


@pytest.mark.asyncio
async def test_an_ask_tool_waits_for_a_grant_then_runs(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start(api_factory, tmp_path)
    accepted = await send(api.node, "careful", "record this")
    (approval,) = await pending(api)
    assert approval["turnId"] == accepted.turn_id and approval["slug"] == "record"
    assert approval["mutating"] is True and approval["expiresAt"]
    waiting = await turn(api, accepted.turn_id)
    assert (waiting["status"], waiting["state"]) == ("running", "awaiting_approval")
    assert not (tmp_path / "ran.txt").exists()  # nothing ran before the answer
    async with httpx.AsyncClient(base_url=api.url) as client:
        r = await client.post(f"/v1/agents/careful/approvals/{approval['approvalId']}",
                              json={"granted": True})  # fmt: skip
        again = await client.post(f"/v1/agents/careful/approvals/{approval['approvalId']}",
                                  json={"granted": True})  # fmt: skip
    assert r.status_code == 200 and r.json() == {"approvalId": approval["approvalId"],
                                                 "granted": True}  # fmt: skip
    assert again.status_code == 404 and again.json()["error"]["code"] == "approval_not_found"
    events = await wait_end(api.node, accepted.turn_id)
    assert events[-1].data.reason == "final"  # type: ignore[union-attr]
    assert (tmp_path / "ran.txt").read_text() == "ran\n"
    (result,) = results(events)
    assert result.ok and result.output == "recorded"
    assert [e.type for e in events].count("approval.resolved") == 1


@pytest.mark.asyncio
async def test_a_denied_call_is_reported_to_the_model_as_a_refusal(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start(api_factory, tmp_path)
    accepted = await send(api.node, "careful", "record that")
    (approval,) = await pending(api)
    async with httpx.AsyncClient(base_url=api.url) as client:
        r = await client.post(f"/v1/agents/careful/approvals/{approval['approvalId']}",
                              json={"granted": False})  # fmt: skip
        blank = await client.post(f"/v1/agents/careful/approvals/{approval['approvalId']}",
                                  json={})  # fmt: skip
    assert r.status_code == 200
    assert blank.status_code == 400 and blank.json()["error"]["code"] in (
        "approval_decision_required", "approval_not_found")  # fmt: skip
    events = await wait_end(api.node, accepted.turn_id)
    (result,) = results(events)
    assert result.refused and not result.ok and "api denied it" in (result.output or "")
    assert not (tmp_path / "ran.txt").exists()
    end = events[-1].data
    assert end.reason == "final" and "refused" in end.text  # type: ignore[union-attr]
    gated = [e.data for e in events if isinstance(e.data, ToolGated)]
    assert [g.policy for g in gated] == ["ask"]


@pytest.mark.asyncio
async def test_a_deny_policy_refuses_without_asking(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start(api_factory, tmp_path)
    accepted = await send(api.node, "careful", "sum")
    events = await wait_end(api.node, accepted.turn_id)
    (result,) = results(events)
    assert result.refused and "does not allow calculator" in (result.output or "")
    assert not any(e.type == "approval.requested" for e in events)


@pytest.mark.asyncio
async def test_an_unanswered_approval_times_out_as_denied(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start(api_factory, tmp_path, timeout=0.5)
    accepted = await send(api.node, "careful", "record late")
    events = await wait_end(api.node, accepted.turn_id)
    resolved = [e.data for e in events if isinstance(e.data, ApprovalResolved)]
    assert [(r.granted, r.by) for r in resolved] == [(False, "timeout")]
    (result,) = results(events)
    assert result.refused and "timed out" in (result.output or "")


@pytest.mark.asyncio
async def test_the_wait_survives_a_restart_and_a_websocket_answers_it(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start(api_factory, tmp_path)
    accepted = await send(api.node, "careful", "record across a restart")
    (approval,) = await pending(api)
    await api.stop()
    await api_factory.nodes.started.pop().stop()
    api = await api_factory.start()
    (still,) = await pending(api)
    assert still["approvalId"] == approval["approvalId"]
    async with websockets.connect(api.ws_url + "?agentId=careful") as ws:
        assert json.loads(await ws.recv())["type"] == "ws.open"
        answered = await approve_when_restored(ws, approval["approvalId"])
    assert answered["granted"] is True and answered["ref"] == "a1"
    events = await wait_end(api.node, accepted.turn_id)
    assert events[-1].data.reason == "final"  # type: ignore[union-attr]
    assert (tmp_path / "ran.txt").read_text() == "ran\n"


async def approve_when_restored(ws: Any, approval_id: str, timeout: float = 15) -> dict[str, Any]:
    """Grant over the socket, again while the answer is ``approval_busy``: right after a start
    the turn is still being restored, and that refusal says to retry in a moment (a client
    does). Any other answer is returned, or fails the test if it is not ``ws.approved``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        await ws.send(json.dumps({"type": "approve", "approvalId": approval_id, "granted": True,
                                  "ref": "a1"}))  # fmt: skip
        answer: dict[str, Any] = json.loads(await ws.recv())
        busy = answer["type"] == "ws.error" and answer.get("code") == "approval_busy"
        if not busy or asyncio.get_running_loop().time() > deadline:
            assert answer["type"] == "ws.approved", answer
            return answer
        await asyncio.sleep(0.1)


@pytest.mark.asyncio
async def test_stopping_a_waiting_turn_ends_it_without_running_the_call(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start(api_factory, tmp_path)
    accepted = await send(api.node, "careful", "record never")
    await pending(api)
    async with httpx.AsyncClient(base_url=api.url) as client:
        r = await client.post(f"/v1/agents/careful/turns/{accepted.turn_id}/stop")
    assert r.status_code == 202
    events = await wait_end(api.node, accepted.turn_id)
    assert events[-1].data.reason == "stopped"  # type: ignore[union-attr]
    assert not (tmp_path / "ran.txt").exists()
    assert (await pending_count(api)) == 0


async def pending_count(api: ApiServer) -> int:
    async with httpx.AsyncClient(base_url=api.url) as client:
        return len((await client.get("/v1/agents/careful/approvals")).json()["approvals"])


READER = """
id: reader
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {url}
  api_key_env: DISPACH_TEST_ANTHROPIC_KEY
tools:
  - name: fetch
    module: tests.fixtures_tools:fetch_page
    description: Fetches a page.
    untrusted_output: true
    input_schema: {{type: object, properties: {{url: {{type: string}}}}}}
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran.
    mutating: true
    input_schema: {{type: object, properties: {{path: {{type: string}}}}, required: [path]}}
limits: {{untrusted_on_mutate: {on_mutate}}}
"""


@pytest.mark.asyncio
@pytest.mark.parametrize("on_mutate", ["ask", "deny"])
async def test_after_untrusted_content_a_mutating_call_needs_approval(
    api_factory: ApiFactory,
    tmp_path: Path,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    on_mutate: str,
) -> None:
    monkeypatch.setenv("DISPACH_TEST_ANTHROPIC_KEY", "test-key")
    ran = tmp_path / "ran.txt"
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("fetch", {"url": "https://example.com"}, id="toolu_fetch")]),
        Reply(tool_uses=[ToolUse("record", {"path": str(ran)}, id="toolu_record")]),
        Reply(text="Done."),
    )
    api_factory.write_agent("reader", READER.format(url=fake_anthropic.url, on_mutate=on_mutate))
    api = await api_factory.start()
    accepted = await send(api.node, "reader", "read the page, then record it")
    if on_mutate == "ask":
        async with httpx.AsyncClient(base_url=api.url) as client:
            for _ in range(200):
                listed = (await client.get("/v1/agents/reader/approvals")).json()["approvals"]
                if listed:
                    break
                await asyncio.sleep(0.05)
            (approval,) = listed
            assert approval["slug"] == "record" and not ran.exists()
            r = await client.post(f"/v1/agents/reader/approvals/{approval['approvalId']}",
                                  json={"granted": True})  # fmt: skip
            assert r.status_code == 200
    events = await wait_end(api.node, accepted.turn_id)
    fetched, recorded = results(events)
    assert fetched.trust == "untrusted" and recorded.slug == "record"
    gated = [e.data for e in events if isinstance(e.data, ToolGated)]
    assert [g.policy for g in gated] == ["untrusted"]
    if on_mutate == "ask":
        assert recorded.ok and ran.read_text() == "ran\n"
    else:
        assert recorded.refused and "untrusted content" in (recorded.output or "")
        assert not ran.exists()
    assert events[-1].data.reason == "final"  # type: ignore[union-attr]
