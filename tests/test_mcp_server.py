"""Dispach agents as an MCP server, driven by the ``mcp`` SDK's own client: ``dispach mcp`` as a
real stdio subprocess in front of a real node, and ``/v1/mcp`` over streamable HTTP on the node,
behind its bearer token."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from mcp import Client as McpClient
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import TextContent

from gateways.client import Client
from gateways.mcp.server import server
from tests.conftest import ApiFactory, ApiServer
from tests.test_approvals import CAREFUL, pending, turn

DISPACH = str(Path(sys.executable).parent / "dispach")
ROOT = Path(__file__).resolve().parent.parent
TOKEN = "mcp-test-token"
OFFLINE = "[scripted model, offline] You said: "


@contextlib.asynccontextmanager
async def stdio_session(api: ApiServer) -> AsyncIterator[ClientSession]:
    """``dispach mcp`` for the node at ``api``, as an MCP host starts it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISPACH_")}
    env |= {"DISPACH_URL": api.url, "NO_PROXY": "127.0.0.1,localhost", "PYTHONPATH": str(ROOT)}
    if api.token:
        env["DISPACH_API_TOKEN"] = api.token
    params = StdioServerParameters(command=DISPACH, args=["mcp"], env=env)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@contextlib.asynccontextmanager
async def http_session(api: ApiServer, token: str | None) -> AsyncIterator[ClientSession]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=30) as http,
        streamable_http_client(f"{api.url}/v1/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def error(result: Any) -> dict[str, Any]:
    assert result.is_error, result
    found: dict[str, Any] = result.structured_content["error"]
    assert found["message"] and found["hint"]
    return found


async def ended(api: ApiServer, turn_id: str) -> dict[str, Any]:
    """The turn once it is no longer running (within 10 s)."""
    with anyio.fail_after(10):
        while (found := await turn(api, turn_id))["status"] == "running":
            await anyio.sleep(0.05)
    return found


async def start_careful(api_factory: ApiFactory, tmp_path: Path, **kw: Any) -> ApiServer:
    manifest = CAREFUL.format(path=tmp_path / "ran.txt", timeout=60)
    api_factory.write_agent("careful", manifest)
    return await api_factory.start(**kw)


@pytest.mark.asyncio
async def test_dispach_mcp_sends_a_message_and_streams_its_reply(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start_careful(api_factory, tmp_path, tokens=[TOKEN])
    pieces: list[tuple[float, str | None]] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        pieces.append((progress, message))

    async with stdio_session(api) as mcp:
        tools = {t.name for t in (await mcp.list_tools()).tools}
        assert tools == {
            "list_agents",
            "send_message",
            "get_turn",
            "list_approvals",
            "answer_approval",
        }
        listed = await mcp.call_tool("list_agents", {})
        assert {"assistant", "careful"} <= {a["id"] for a in listed.structured_content["agents"]}

        sent = await mcp.call_tool(
            "send_message",
            {"agent": "assistant", "text": "hello over mcp", "sessionKey": "mcp:one"},
            progress_callback=progress,
        )
        assert not sent.is_error, sent
        body = sent.structured_content
        (shown,) = sent.content
        assert isinstance(shown, TextContent) and shown.text == body["text"]
        assert body["text"].startswith(f"{OFFLINE}hello over mcp")
        assert (body["status"], body["sessionKey"]) == ("final", "mcp:one")
        # The reply arrived as it was written: its pieces, in order, with growing progress.
        assert "".join(m or "" for _, m in pieces) == body["text"]
        assert [p for p, _ in pieces] == sorted({p for p, _ in pieces}) and pieces

        turn = await mcp.call_tool("get_turn", {"agent": "assistant", "turnId": body["turnId"]})
        assert not turn.is_error
        assert turn.structured_content["text"] == body["text"]
        assert turn.structured_content["sessionKey"] == "mcp:one"

        quiet = await mcp.call_tool("send_message", {"agent": "assistant", "text": "again"})
        assert quiet.structured_content["text"].startswith(f"{OFFLINE}again")


@pytest.mark.asyncio
async def test_dispach_mcp_answers_bad_input_with_the_api_error(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start_careful(api_factory, tmp_path, tokens=[TOKEN])
    async with stdio_session(api) as mcp:
        missing = error(await mcp.call_tool("send_message", {"agent": "assistant"}))
        assert (missing["code"], missing["field"]) == ("invalid_value", "text")
        wrong = error(
            await mcp.call_tool(
                "answer_approval", {"agent": "careful", "approvalId": "x", "granted": 1}
            )
        )
        assert (wrong["code"], wrong["field"]) == ("invalid_value", "granted")
        extra = error(await mcp.call_tool("list_agents", {"all": True}))
        assert extra["code"] == "invalid_value"
        nobody = error(await mcp.call_tool("send_message", {"agent": "nobody", "text": "hi"}))
        assert nobody["status"] == 404 and nobody["code"] == "agent_not_found"
        no_turn = error(await mcp.call_tool("get_turn", {"agent": "assistant", "turnId": "t-0"}))
        assert no_turn["status"] == 404
        assert error(await mcp.call_tool("launch", {}))["code"] == "unknown_tool"


@pytest.mark.asyncio
async def test_dispach_mcp_without_the_token_reports_the_refusal(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start_careful(api_factory, tmp_path, tokens=[TOKEN])
    api.token = None
    async with stdio_session(api) as mcp:
        refused = error(await mcp.call_tool("list_agents", {}))
        assert (refused["status"], refused["code"]) == (401, "unauthorized")


@pytest.mark.asyncio
async def test_an_approval_is_listed_and_answered_while_the_message_waits(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start_careful(api_factory, tmp_path)
    async with stdio_session(api) as mcp, anyio.create_task_group() as tg:
        sent: list[Any] = []

        async def send() -> None:
            sent.append(
                await mcp.call_tool("send_message", {"agent": "careful", "text": "record this"})
            )

        tg.start_soon(send)
        waiting: list[dict[str, Any]] = []
        with anyio.fail_after(20):
            while not waiting:
                listed = await mcp.call_tool("list_approvals", {})
                waiting = listed.structured_content["approvals"]
                await anyio.sleep(0.05)
        (approval,) = waiting
        assert approval["slug"] == "record" and approval["args"]["path"].endswith("ran.txt")
        assert not sent and not (tmp_path / "ran.txt").exists()
        answered = await mcp.call_tool(
            "answer_approval",
            {"agent": "careful", "approvalId": approval["approvalId"], "granted": True},
        )
        assert answered.structured_content == {
            "approvalId": approval["approvalId"],
            "granted": True,
        }
        with anyio.fail_after(20):
            while not sent:
                await anyio.sleep(0.05)
    assert sent[0].structured_content["status"] == "final", sent[0]
    assert (tmp_path / "ran.txt").read_text() == "ran\n"


@pytest.mark.asyncio
async def test_v1_mcp_over_streamable_http_behind_the_token(api_factory: ApiFactory) -> None:
    api = await api_factory.start(tokens=[TOKEN])
    pieces: list[str] = []

    async def progress(progress: float, total: float | None, message: str | None) -> None:
        pieces.append(message or "")

    async with http_session(api, TOKEN) as mcp:
        assert "send_message" in {t.name for t in (await mcp.list_tools()).tools}
        sent = await mcp.call_tool(
            "send_message",
            {"agent": "assistant", "text": "hi over http"},
            progress_callback=progress,
        )
        assert not sent.is_error, sent
        assert sent.structured_content["text"].startswith(f"{OFFLINE}hi over http")
        assert "".join(pieces) == sent.structured_content["text"]
        bad = error(await mcp.call_tool("get_turn", {"agent": "assistant"}))
        assert (bad["code"], bad["field"]) == ("invalid_value", "turnId")

    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    accept = {"Accept": "application/json, text/event-stream"}
    async with httpx.AsyncClient(base_url=api.url) as plain:
        anonymous = await plain.post("/v1/mcp", json=body, headers=accept)
        forged = await plain.post(
            "/v1/mcp", json=body, headers={**accept, "Authorization": "Bearer nope"}
        )
        page = await plain.post(
            "/v1/mcp",
            json=body,
            headers={
                **accept,
                "Origin": "https://evil.example",
                "Authorization": f"Bearer {TOKEN}",
            },
        )
    assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "unauthorized"
    hint = anonymous.json()["error"]["hint"]
    assert hint.startswith("send `Authorization: Bearer <token or key>`")
    assert forged.status_code == 401
    # RFC 9110 11.6.1: a 401 names the scheme that would be accepted (MCP clients read it to
    # know a bearer token is wanted); a token that was sent and refused is invalid_token
    # (RFC 6750 3.1).
    assert anonymous.headers["www-authenticate"] == 'Bearer realm="dispach"'
    assert forged.headers["www-authenticate"] == 'Bearer realm="dispach", error="invalid_token"'
    assert page.status_code == 403 and page.json()["error"]["code"] == "origin_not_allowed"


@pytest.mark.asyncio
async def test_a_cancelled_send_message_stops_its_turn(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start_careful(api_factory, tmp_path)
    async with stdio_session(api) as mcp:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                mcp.call_tool, "send_message", {"agent": "careful", "text": "record this"}
            )
            (approval,) = await pending(api)
            tg.cancel_scope.cancel()  # the SDK sends notifications/cancelled for the call
        # Nobody waits for the reply: the turn is stopped, not left waiting on its approval.
        assert (await ended(api, approval["turnId"]))["status"] == "stopped"
        assert not (tmp_path / "ran.txt").exists()
        assert (await mcp.call_tool("list_approvals", {})).structured_content["approvals"] == []


@pytest.mark.asyncio
async def test_a_host_that_leaves_v1_mcp_mid_message_stops_its_turn(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start_careful(api_factory, tmp_path)

    async def host() -> None:
        async with http_session(api, None) as mcp:
            await mcp.call_tool("send_message", {"agent": "careful", "text": "record this"})

    async with anyio.create_task_group() as tg:
        tg.start_soon(host)
        (approval,) = await pending(api)
        tg.cancel_scope.cancel()  # the host closes its connections
    assert (await ended(api, approval["turnId"]))["status"] == "stopped"


@pytest.mark.asyncio
async def test_v1_mcp_refuses_malformed_requests_without_a_5xx(api_factory: ApiFactory) -> None:
    api = await api_factory.start(tokens=[TOKEN])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    post = {
        **auth,
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
    }
    tools_list = b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}'

    async def chunked(size: int) -> AsyncIterator[bytes]:
        for _ in range(size // 100_000 + 1):
            yield b" " * 100_000

    async with httpx.AsyncClient(base_url=api.url, timeout=10) as plain:

        async def refused(status: int, method: str = "POST", **kw: Any) -> Any:
            answer = await plain.request(method, "/v1/mcp", **kw)
            assert answer.status_code == status, (method, kw.get("headers"), answer.text)
            return answer.json() if answer.content else None

        def envelope(found: Any, code: str) -> None:
            assert found["error"]["code"] == code and found["error"]["hint"], found

        # A GET stream (or a session to DELETE) is not offered: 405 at once, not a silent stream.
        for method in ("GET", "DELETE", "PUT"):
            envelope(await refused(405, method, headers=auth), "method_not_allowed")
        assert (await plain.get("/v1/mcp", headers=auth)).headers["allow"] == "POST"
        # What is not JSON never reaches the MCP SDK; a body over the cap neither, however sent.
        envelope(
            await refused(415, headers={**auth, "Content-Type": "text/plain"}, content=tools_list),
            "content_type_unsupported",
        )
        envelope(await refused(413, headers=post, content=b" " * 1_000_001), "body_too_large")
        envelope(await refused(413, headers=post, content=chunked(1_000_001)), "body_too_large")
        # JSON that is not one JSON-RPC message: the SDK's JSON-RPC error, as MCP has it.
        for body in (
            b"{nope",
            b"null",
            b"[" + tools_list + b"," + tools_list + b"]",
            b"[" * 100_000 + b"]" * 100_000,
            b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        ):
            found = await refused(400, headers=post, content=body)
            assert found["jsonrpc"] == "2.0" and found["error"]["code"] in (-32700, -32602, -32600)
        # Through all of that the node stayed whole: the endpoint still answers.
        listed = await plain.post("/v1/mcp", headers=post, content=tools_list)
        assert listed.status_code == 200 and b'"send_message"' in listed.content


@pytest.mark.asyncio
async def test_dispach_mcp_writes_only_mcp_frames_and_exits_when_stdin_ends(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    """``dispach mcp`` driven by hand: every stdout line is one JSON-RPC message, and a host that
    closes stdin while a message waits on its turn gets the process back at once, turn
    stopped."""
    api = await start_careful(api_factory, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISPACH_")}
    env |= {"DISPACH_URL": api.url, "NO_PROXY": "127.0.0.1,localhost", "PYTHONPATH": str(ROOT)}
    frames = [
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "test", "version": "1"},
            },
        },
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {
                "name": "send_message",
                "_meta": {"progressToken": "p"},
                "arguments": {"agent": "assistant", "text": "hello by hand"},
            },
        },
    ]
    waits = {
        "jsonrpc": "2.0",
        "id": 3,
        "method": "tools/call",
        "params": {
            "name": "send_message",
            "arguments": {"agent": "careful", "text": "record this"},
        },
    }
    async with await anyio.open_process(
        [DISPACH, "mcp"], env=env, stderr=subprocess.DEVNULL
    ) as process:
        assert process.stdin and process.stdout
        for frame in frames:
            await process.stdin.send(json.dumps(frame).encode() + b"\n")
        out = b""
        with anyio.fail_after(20):
            while b'"id":2' not in out:
                out += await process.stdout.receive()
            await process.stdin.send(json.dumps(waits).encode() + b"\n")
            (approval,) = await pending(api)
            await process.stdin.aclose()
            async for more in process.stdout:
                out += more
            assert await process.wait() == 0
    messages = [json.loads(line) for line in out.decode().splitlines()]
    assert all(m["jsonrpc"] == "2.0" for m in messages), out
    progress = [
        m["params"]["message"] for m in messages if m.get("method") == "notifications/progress"
    ]
    (reply,) = [m["result"] for m in messages if m.get("id") == 2]
    assert reply["structuredContent"]["text"].startswith(f"{OFFLINE}hello by hand")
    assert "".join(progress) == reply["structuredContent"]["text"]
    assert (await ended(api, approval["turnId"]))["status"] == "stopped"


@pytest.mark.asyncio
async def test_calls_past_the_thread_limit_are_refused_busy(
    api_factory: ApiFactory, tmp_path: Path
) -> None:
    api = await start_careful(api_factory, tmp_path)
    one = server(lambda: Client(api.url), limiter=anyio.CapacityLimiter(1))
    async with McpClient(one) as mcp, anyio.create_task_group() as tg:
        sent: list[Any] = []

        async def send() -> None:
            sent.append(
                await mcp.call_tool("send_message", {"agent": "careful", "text": "record this"})
            )

        tg.start_soon(send)
        (approval,) = await pending(api)
        busy = error(await mcp.call_tool("list_agents", {}))
        assert (busy["code"], busy["status"]) == ("mcp_busy", 503)
        async with httpx.AsyncClient(base_url=api.url) as plain:
            decided = await plain.post(
                f"/v1/agents/careful/approvals/{approval['approvalId']}", json={"granted": False}
            )
            assert decided.status_code == 200, decided.text
        with anyio.fail_after(10):
            while not sent:
                await anyio.sleep(0.05)
        assert not (await mcp.call_tool("list_agents", {})).is_error
