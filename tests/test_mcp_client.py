"""Agents take tools from MCP servers (issue 18): the kit (tests/mcp_servers/kit.py, the official
SDK's server) run as a real process, over stdio by the node and over streamable HTTP on its own,
in front of an in-process node and the fake Anthropic server. What the model received is read
from the fake's recorded requests; what the node recorded, from its events."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from eventstore import RecordedEvent
from eventstore.catalogue import ToolCall, ToolResult, TurnEnd
from gateways.mcp.sources import McpSources
from runtime.manifest import ManifestError
from runtime.node import Node
from tests import fakes
from tests.conftest import ROOT, ApiFactory, ApiServer, NodeFactory
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.mcp_servers import kit
from tests.test_node import free_port
from tests.test_schedules import settings_of
from tests.turns import send, wait_end

fake_anthropic = fakes.fake_anthropic

AGENT = "toolsmith"
KEY_ENV = "DISPACH_TEST_ANTHROPIC_KEY"
TOKEN = "mcp-client-test-token"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

Json = dict[str, Any]


# --- the agent and its servers -----------------------------------------------------------------


def stdio_kit(record: Path, *, name: str = "kit", mode: str = "normal", extra: str = "") -> str:
    """An ``mcp_servers`` entry: the kit, started by the node on stdio; ``extra``: more keys."""
    return f"""
  - name: {name}
    command: {sys.executable}
    args: ["-m", "tests.mcp_servers.kit", "--record", "{record}", "--mode", "{mode}"]
    cwd: {ROOT}{extra}"""


def http_kit(url: str, *, name: str = "web", extra: str = "") -> str:
    return f"""
  - name: {name}
    url: {url}{extra}"""


def manifest(fake: FakeAnthropic, servers: str, *, tools: str = "tools: []",
             limits: str = "") -> str:  # fmt: skip
    return f"""
id: {AGENT}
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {fake.url}
  api_key_env: {KEY_ENV}
  max_output_tokens: 1024
{tools}
mcp_servers:{servers}
limits:
  tool_timeout_s: 20{limits}
"""


async def start(api_factory: ApiFactory, fake: FakeAnthropic, monkeypatch: pytest.MonkeyPatch,
                servers: str, expect: str = "kit__echo", **kw: str) -> ApiServer:  # fmt: skip
    """A node serving the agent, once ``expect`` is among its tools (the node waits a bounded
    time for its servers at start; a slow one joins later)."""
    monkeypatch.setenv(KEY_ENV, "test-key")
    api_factory.write_agent(AGENT, manifest(fake, servers, **kw))
    api = await api_factory.start(tokens=[TOKEN])
    await until(lambda: _has_tool(api, expect), f"the agent to offer {expect}", 20)
    return api


async def _has_tool(api: ApiServer, name: str) -> bool:
    return name in await tool_names(api)


async def tool_names(api: ApiServer) -> list[str]:
    """The agent's tools as GET …/tools lists them."""
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers, timeout=10) as http:
        r = await http.get(f"/v1/agents/{AGENT}/tools")
    assert r.status_code == 200, r.text
    body = r.json()
    listed = body["tools"] if isinstance(body, dict) else body
    return [t["slug"] for t in listed]


def spawn_http_kit(port: int, record: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.mcp_servers.kit", "--transport", "http",
             "--port", str(port), "--record", str(record)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


@pytest_asyncio.fixture
async def web_kit(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """The kit as a streamable HTTP server of its own (a real subprocess on a free port): its
    URL and its record directory. Listed before ``api_factory`` in a test, it outlives the
    node."""
    record = tmp_path / "web"
    port = free_port()
    process = spawn_http_kit(port, record, tmp_path / "web-kit.log")
    try:

        async def listening() -> bool:
            assert process.poll() is None, (tmp_path / "web-kit.log").read_text()
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                return False
            writer.close()
            return True

        await until(listening, "the HTTP kit to listen", 20)
        yield f"http://127.0.0.1:{port}/mcp", record
    finally:
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 10)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait, 10)


# --- reading what happened ---------------------------------------------------------------------


async def until(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    """Poll ``predicate`` (a function or a coroutine function) until it is true."""
    deadline = time.monotonic() + timeout
    while True:
        found = predicate()
        if asyncio.iscoroutine(found):
            found = await found
        if found:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.05)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def results(events: list[RecordedEvent]) -> dict[str, ToolResult]:
    return {e.data.call_id: e.data for e in events if isinstance(e.data, ToolResult)}


def calls(events: list[RecordedEvent]) -> dict[str, ToolCall]:
    return {e.data.call_id: e.data for e in events if isinstance(e.data, ToolCall)}


def end_of(events: list[RecordedEvent]) -> TurnEnd:
    end = events[-1].data
    assert isinstance(end, TurnEnd), [e.type for e in events]
    return end


def offered(fake: FakeAnthropic, index: int) -> list[str]:
    """The tool names the model was offered in request ``index``."""
    return [t["name"] for t in fake.message_requests()[index].body.get("tools", [])]


def sent_results(fake: FakeAnthropic, index: int) -> dict[str, Json]:
    """The tool_result blocks the model received in request ``index``, by tool_use_id."""
    content = fake.message_requests()[index].body["messages"][-1]["content"]
    return {b["tool_use_id"]: b for b in content if b["type"] == "tool_result"}


def text_of(block: Json) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    return "\n".join(c.get("text", "") for c in content if c.get("type") == "text")


async def wire_events(api: ApiServer, turn_id: str) -> list[Json]:
    """The turn's events as the API shows them to the API token, private fields included."""
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers, timeout=10) as http:
        r = await http.get(f"/v1/agents/{AGENT}/turns/{turn_id}/events",
                           params={"private": "true", "limit": "10000"})  # fmt: skip
    assert r.status_code == 200, r.text
    events: list[Json] = r.json()["events"]
    return events


def logged(caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> str:
    """Everything the node logged (through logging, or structlog printing to the terminal)."""
    out, err = capfd.readouterr()
    records = "\n".join(f"{r.getMessage()} {r.__dict__!r}" for r in caplog.records)
    return "\n".join([records, out, err])


# --- a. two transports, one step ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_one_step_calls_a_stdio_and_an_http_server_and_both_reach_the_model(
    web_kit: tuple[str, Path],
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    url, web_record = web_kit
    servers = stdio_kit(tmp_path / "kit") + http_kit(url)
    fake_anthropic.script(
        Reply(text="Asking both.", tool_uses=[
            ToolUse("kit__echo", {"text": "from stdio"}, id="toolu_kit"),
            ToolUse("web__echo", {"text": "from http"}, id="toolu_web"),
        ]),
        Reply(text="Both answered."),
    )  # fmt: skip
    api = await start(api_factory, fake_anthropic, monkeypatch, servers, expect="web__echo")
    assert {"kit__echo", "web__echo"} <= set(await tool_names(api))
    accepted = await send(api.node, AGENT, "echo on both servers")
    events = await wait_end(api.node, accepted.turn_id)
    end = end_of(events)
    assert end.reason == "final", end

    first = offered(fake_anthropic, 0)
    assert {"kit__echo", "web__echo", "kit__write", "web__write"} <= set(first)
    sent = sent_results(fake_anthropic, 1)
    assert text_of(sent["toolu_kit"]) == "from stdio" and not sent["toolu_kit"]["is_error"]
    assert text_of(sent["toolu_web"]) == "from http" and not sent["toolu_web"]["is_error"]

    stored = results(events)
    for call_id, server in (("toolu_kit", "kit"), ("toolu_web", "web")):
        assert calls(events)[call_id].source == "mcp"
        assert calls(events)[call_id].mcp_server == server
        assert stored[call_id].ok and stored[call_id].source == "mcp"
        assert stored[call_id].mcp_server == server
        assert stored[call_id].error_code is None

    wire = await wire_events(api, accepted.turn_id)
    tool_events = {(e["type"], e["data"]["callId"]): e["data"] for e in wire
                   if e["type"] in ("tool.call", "tool.result")}  # fmt: skip
    for call_id, server, text in (("toolu_kit", "kit", "from stdio"),
                                  ("toolu_web", "web", "from http")):  # fmt: skip
        call = tool_events["tool.call", call_id]
        result = tool_events["tool.result", call_id]
        assert (call["source"], call["mcpServer"]) == ("mcp", server), call
        assert (result["source"], result["mcpServer"]) == ("mcp", server), result
        assert result["ok"] is True and result["output"] == text
        assert "errorCode" not in result or result["errorCode"] is None
    assert len(lines(web_record / "pids.log")) == 1


# --- a2. what the manifest hands a server ------------------------------------------------------


@pytest.mark.asyncio
async def test_env_and_headers_take_their_variables_from_the_nodes_environment(
    web_kit: tuple[str, Path],
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    url, web_record = web_kit
    record = tmp_path / "kit"
    monkeypatch.setenv("DISPACH_TEST_KIT_TOKEN", "kit-secret")
    monkeypatch.setenv("DISPACH_TEST_WEB_TOKEN", "web-secret")
    servers = stdio_kit(record, extra='\n    env: {KIT_TOKEN: "${DISPACH_TEST_KIT_TOKEN}"}')
    servers += http_kit(
        url, extra='\n    headers: {Authorization: "Bearer ${DISPACH_TEST_WEB_TOKEN}"}'
    )
    api = await start(api_factory, fake_anthropic, monkeypatch, servers, expect="web__echo")
    assert "kit__echo" in await tool_names(api)
    assert lines(record / "env.log") == ["kit-secret"]
    assert lines(web_record / "auth.log")
    assert set(lines(web_record / "auth.log")) == {"Bearer web-secret"}


@pytest.mark.asyncio
async def test_a_deny_policy_refuses_and_untrusted_output_is_marked(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    record = tmp_path / "kit"
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("kit__echo", {"text": "from outside"}, id="toolu_echo")]),
        Reply(tool_uses=[ToolUse("kit__write", {"path": "x"}, id="toolu_write")]),
        Reply(text="Refused, as it should be."),
    )
    servers = stdio_kit(record, extra="\n    policy: {write: deny}\n    untrusted_output: true")
    api = await start(api_factory, fake_anthropic, monkeypatch, servers)
    accepted = await send(api.node, AGENT, "echo, then write")
    events = await wait_end(api.node, accepted.turn_id)
    assert end_of(events).reason == "final"
    stored = results(events)
    assert stored["toolu_echo"].ok and stored["toolu_echo"].trust == "untrusted"
    assert stored["toolu_write"].refused and not stored["toolu_write"].ok, stored["toolu_write"]
    assert not (record / "write.log").exists()
    assert "does not allow" in (stored["toolu_write"].output or ""), stored["toolu_write"]
    assert "does not allow" in text_of(sent_results(fake_anthropic, 2)["toolu_write"])


@pytest.mark.asyncio
async def test_a_stdio_server_is_stopped_with_the_node(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    record = tmp_path / "kit"
    api = await start(api_factory, fake_anthropic, monkeypatch, stdio_kit(record))
    (pid,) = lines(record / "pids.log")
    assert alive(int(pid))
    await api.stop()
    api_factory.started.remove(api)
    await asyncio.wait_for(api_factory.nodes.started.pop().stop(), 30)
    await until(lambda: not alive(int(pid)), "the server to exit with its node", 10)


# --- b. a server that dies mid-call ------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_stdio_server_that_crashes_mid_call_is_unavailable_then_restarted(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    record = tmp_path / "kit"
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("kit__crash", {}, id="toolu_crash")]),
        Reply(text="The server crashed."),
        Reply(tool_uses=[ToolUse("kit__echo", {"text": "back again"}, id="toolu_echo")]),
        Reply(text="It is back."),
    )
    api = await start(api_factory, fake_anthropic, monkeypatch, stdio_kit(record))
    (first_pid,) = lines(record / "pids.log")
    accepted = await send(api.node, AGENT, "crash the server")
    events = await wait_end(api.node, accepted.turn_id)
    assert end_of(events).reason == "final"
    crashed = results(events)["toolu_crash"]
    assert not crashed.ok and crashed.error_code == "tool_unavailable", crashed
    assert crashed.source == "mcp" and crashed.mcp_server == "kit"
    assert sent_results(fake_anthropic, 1)["toolu_crash"]["is_error"] is True

    await until(lambda: len(lines(record / "pids.log")) == 2, "the server to be restarted", 20)
    second_pid = lines(record / "pids.log")[1]
    assert second_pid != first_pid
    # The restarted server has been listed: its session is open.
    await until(lambda: second_pid in lines(record / "lists.log"), "the new session", 20)

    follow = await send(api.node, AGENT, "is it back?")
    events = await wait_end(api.node, follow.turn_id)
    assert end_of(events).reason == "final"
    echoed = results(events)["toolu_echo"]
    assert echoed.ok and echoed.output == "back again", echoed
    assert text_of(sent_results(fake_anthropic, 3)["toolu_echo"]) == "back again"


# --- b2. a session left idle ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_idle_session_stays_open_past_the_nodes_health_check(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The node checks an idle session now and then (every 15 s); a server that is fine must
    not be taken for dead by that check, whatever protocol version the session speaks."""
    record = tmp_path / "kit"
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("kit__read", {"seconds": 0}, id="toolu_read")]),
        Reply(text="The same server."),
    )
    api = await start(api_factory, fake_anthropic, monkeypatch, stdio_kit(record))
    (pid,) = lines(record / "pids.log")
    seen = len(lines(record / "methods.log"))
    with contextlib.suppress(AssertionError):  # the check came, or 20 s idle: both will do
        await until(lambda: len(lines(record / "methods.log")) > seen, "the health check", 20)
    with contextlib.suppress(AssertionError):  # the restart that a failed check would bring
        await until(lambda: len(lines(record / "pids.log")) > 1, "a restart", 3)
    accepted = await send(api.node, AGENT, "read once more")
    events = await wait_end(api.node, accepted.turn_id)
    assert end_of(events).reason == "final"
    read = results(events)["toolu_read"]
    assert read.ok and read.output == "read", read
    assert lines(record / "read.log") == [pid]  # run by the first server
    assert lines(record / "pids.log") == [pid], "the node restarted a server that was fine"


# --- c. a server that never answers ------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_hung_call_times_out_and_the_server_is_told_to_cancel(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    record = tmp_path / "kit"
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("kit__hang", {}, id="toolu_hang")]),
        Reply(text="It never answered."),
    )
    servers = stdio_kit(record, extra="\n    timeout_s: 1")
    api = await start(api_factory, fake_anthropic, monkeypatch, servers)
    asked = time.monotonic()
    accepted = await send(api.node, AGENT, "wait forever")
    events = await wait_end(api.node, accepted.turn_id, timeout=20)
    took = time.monotonic() - asked
    assert end_of(events).reason == "final"
    hung = results(events)["toolu_hang"]
    assert not hung.ok and hung.error_code == "tool_timeout", hung
    assert hung.latency_ms < 5000 and took < 10, (hung.latency_ms, took)
    assert sent_results(fake_anthropic, 1)["toolu_hang"]["is_error"] is True

    await until(lambda: lines(record / "cancelled.log"), "the server to see the cancel", 10)
    (pid,) = lines(record / "pids.log")
    (cancelled,) = lines(record / "cancelled.log")
    # Cancelled by notifications/cancelled, not by the server being stopped: the same process
    # is still running (and was never restarted).
    assert cancelled.split()[0] == pid
    os.kill(int(pid), 0)


# --- d. a policy that asks ---------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_ask_policy_parks_the_call_until_a_person_grants_it(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    record = tmp_path / "kit"
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("kit__write", {"path": "notes.txt"}, id="toolu_write")]),
        Reply(text="Written."),
    )
    servers = stdio_kit(record, extra="\n    policy: {write: ask}")
    api = await start(api_factory, fake_anthropic, monkeypatch, servers)
    accepted = await send(api.node, AGENT, "write the notes")
    async with httpx.AsyncClient(base_url=api.url, headers=api.headers, timeout=10) as http:
        listed: list[Json] = []

        async def parked() -> bool:
            listed[:] = (await http.get(f"/v1/agents/{AGENT}/approvals")).json()["approvals"]
            return bool(listed)

        await until(parked, "the approval to be asked", 20)
        (approval,) = listed
        assert approval["turnId"] == accepted.turn_id and approval["slug"] == "kit__write"
        assert approval["mutating"] is True
        assert not (record / "write.log").exists()  # nothing ran before the answer
        r = await http.post(f"/v1/agents/{AGENT}/approvals/{approval['approvalId']}",
                            json={"granted": True})  # fmt: skip
        assert r.status_code == 200, r.text
    events = await wait_end(api.node, accepted.turn_id)
    assert end_of(events).reason == "final"
    wrote = results(events)["toolu_write"]
    assert wrote.ok and wrote.output == "wrote" and wrote.mcp_server == "kit", wrote
    assert calls(events)["toolu_write"].mutating is True
    assert len(lines(record / "write.log")) == 1


# --- e. what is more than text -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_images_resources_and_tool_errors_reach_the_model_as_such(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    fake_anthropic.script(
        Reply(tool_uses=[
            ToolUse("kit__image", {}, id="toolu_image"),
            ToolUse("kit__fail", {}, id="toolu_fail"),
            ToolUse("kit__resource", {}, id="toolu_resource"),
        ]),
        Reply(text="Seen all three."),
    )  # fmt: skip
    api = await start(api_factory, fake_anthropic, monkeypatch, stdio_kit(tmp_path / "kit"))
    accepted = await send(api.node, AGENT, "show me")
    events = await wait_end(api.node, accepted.turn_id)
    assert end_of(events).reason == "final"
    sent = sent_results(fake_anthropic, 1)

    image = sent["toolu_image"]
    assert image["is_error"] is False and isinstance(image["content"], list), image
    (picture,) = [b for b in image["content"] if b["type"] == "image"]
    assert picture["source"]["type"] == "base64"
    assert picture["source"]["media_type"] == "image/png"
    assert base64.b64decode(picture["source"]["data"]) == kit.png()
    assert base64.b64decode(picture["source"]["data"]).startswith(PNG_SIGNATURE)
    assert kit.IMAGE_TEXT in text_of(image)

    failed = sent["toolu_fail"]
    assert failed["is_error"] is True and "the kit failed on purpose" in text_of(failed)
    assert kit.NOTE_TEXT in text_of(sent["toolu_resource"])
    assert sent["toolu_resource"]["is_error"] is False

    stored = results(events)
    assert stored["toolu_image"].ok and stored["toolu_image"].content is not None
    assert not stored["toolu_fail"].ok and stored["toolu_fail"].error_code == "tool_error"
    assert stored["toolu_resource"].ok


# --- f. what a server must not break -----------------------------------------------------------


@pytest.mark.asyncio
async def test_a_tool_with_an_invalid_schema_is_left_out_and_the_rest_work(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.INFO)
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("kit__echo", {"text": "still works"}, id="toolu_echo")]),
        Reply(text="Fine."),
    )
    servers = stdio_kit(tmp_path / "kit", mode="bad-schema")
    api = await start(api_factory, fake_anthropic, monkeypatch, servers)
    assert "kit__broken" not in await tool_names(api)
    accepted = await send(api.node, AGENT, "echo")
    events = await wait_end(api.node, accepted.turn_id)
    assert end_of(events).reason == "final"
    first = offered(fake_anthropic, 0)
    assert "kit__echo" in first and "kit__broken" not in first
    assert results(events)["toolu_echo"].output == "still works"
    text = logged(caplog, capfd)
    assert "mcp_tool_refused" in text and "broken" in text


@pytest.mark.asyncio
async def test_tool_names_that_clash_are_refused_and_the_node_stays_up(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The kit's ``shout`` becomes ``kit__shout``, a local tool's name already: the local one
    stays. Its ``dup.name`` and ``dup_name`` both become ``kit__dup_name``: one of them only."""
    caplog.set_level(logging.INFO)
    local = """tools:
  - name: kit__shout
    module: tests.fixtures_tools:shout
    description: Shouts the text.
    input_schema: {type: object, properties: {text: {type: string}}, required: [text]}"""
    fake_anthropic.script(
        Reply(tool_uses=[
            ToolUse("kit__shout", {"text": "hi"}, id="toolu_shout"),
            ToolUse("kit__echo", {"text": "echoed"}, id="toolu_echo"),
        ]),
        Reply(text="Done."),
    )  # fmt: skip
    servers = stdio_kit(tmp_path / "kit", mode="clash")
    api = await start(api_factory, fake_anthropic, monkeypatch, servers, tools=local)
    names = await tool_names(api)
    assert names.count("kit__shout") == 1 and names.count("kit__dup_name") == 1, names
    accepted = await send(api.node, AGENT, "shout and echo")
    events = await wait_end(api.node, accepted.turn_id)
    assert end_of(events).reason == "final"
    first = offered(fake_anthropic, 0)
    assert len(first) == len(set(first)), first
    assert first.count("kit__shout") == 1 and "kit__echo" in first
    stored = results(events)
    assert stored["toolu_shout"].output == "HI"  # the local tool ran, not the server's
    assert stored["toolu_shout"].source is None
    assert stored["toolu_echo"].output == "echoed" and stored["toolu_echo"].source == "mcp"
    text = logged(caplog, capfd)
    assert "mcp_tool_refused" in text and "shout" in text and "dup" in text
    fake_anthropic.script(Reply(text="Still here."))
    follow = await send(api.node, AGENT, "still there?")
    assert end_of(await wait_end(api.node, follow.turn_id)).reason == "final"


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_a_50_mb_result_is_cut_to_the_limit_and_the_node_lives_on(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    limit = 4000
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("kit__big", {"megabytes": 50}, id="toolu_big")]),
        Reply(text="That was big."),
        Reply(tool_uses=[ToolUse("kit__echo", {"text": "small"}, id="toolu_small")]),
        Reply(text="Small now."),
    )
    servers = stdio_kit(tmp_path / "kit", extra="\n    timeout_s: 150")
    api = await start(api_factory, fake_anthropic, monkeypatch, servers,
                      limits=f"\n  max_tool_output_chars: {limit}")  # fmt: skip
    accepted = await send(api.node, AGENT, "a big one")
    events = await wait_end(api.node, accepted.turn_id, timeout=180)
    assert end_of(events).reason == "final"
    big = results(events)["toolu_big"]
    assert big.ok and big.truncated, (big.ok, big.truncated, big.error_code)
    assert big.output is not None and len(big.output) <= limit + 500, len(big.output or "")
    assert big.output.startswith("BEGIN") and big.output.endswith("END")
    assert big.bytes >= 50_000_000
    assert len(text_of(sent_results(fake_anthropic, 1)["toolu_big"])) <= limit + 500
    follow = await send(api.node, AGENT, "a small one")
    events = await wait_end(api.node, follow.turn_id)
    assert results(events)["toolu_small"].output == "small"


@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_a_result_over_the_transport_s_limit_is_a_clear_error_and_the_server_comes_back(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    record = tmp_path / "kit"
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("kit__big", {"megabytes": 70}, id="toolu_huge")]),
        Reply(text="Too big."),
        Reply(tool_uses=[ToolUse("kit__echo", {"text": "after"}, id="toolu_after")]),
        Reply(text="Back."),
    )
    servers = stdio_kit(record, extra="\n    timeout_s: 150")
    api = await start(api_factory, fake_anthropic, monkeypatch, servers)
    accepted = await send(api.node, AGENT, "a huge one")
    events = await wait_end(api.node, accepted.turn_id, timeout=180)
    assert end_of(events).reason == "final"
    huge = results(events)["toolu_huge"]
    assert not huge.ok and huge.error_code == "tool_failed", huge
    assert huge.output is not None and "64 MiB" in huge.output
    assert "Ask the tool for less" in huge.output

    live = api.node.sources["mcp_servers"]
    assert isinstance(live, McpSources)
    [kit] = live.hub.connections
    await until(lambda: kit.state == "up" and kit.sessions == 2, "the kit up again", 30)
    assert len(lines(record / "pids.log")) == 2
    follow = await send(api.node, AGENT, "and now?")
    events = await wait_end(api.node, follow.turn_id)
    assert results(events)["toolu_after"].output == "after"


@pytest.mark.asyncio
async def test_a_result_over_a_megabyte_from_an_http_server_is_cut_too(
    web_kit: tuple[str, Path],
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over HTTP a result comes as one server-sent event, which the SDK reads up to 1 MiB by
    default: a 3 MB result must still be cut like any other, and the session go on."""
    url, _ = web_kit
    limit = 4000
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("web__big", {"megabytes": 3}, id="toolu_big")]),
        Reply(text="That was big."),
        Reply(tool_uses=[ToolUse("web__echo", {"text": "small"}, id="toolu_small")]),
        Reply(text="Small now."),
    )
    api = await start(api_factory, fake_anthropic, monkeypatch, http_kit(url), expect="web__big",
                      limits=f"\n  max_tool_output_chars: {limit}")  # fmt: skip
    accepted = await send(api.node, AGENT, "a big one")
    events = await wait_end(api.node, accepted.turn_id, timeout=60)
    assert end_of(events).reason == "final"
    follow = await send(api.node, AGENT, "a small one")
    small = results(await wait_end(api.node, follow.turn_id))["toolu_small"]
    assert small.ok and small.output == "small", small
    big = results(events)["toolu_big"]
    assert big.ok and big.truncated, big
    assert big.output is not None and len(big.output) <= limit + 500
    assert big.output.startswith("BEGIN") and big.output.endswith("END")


# --- g. a server whose tools change ------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_tool_added_by_the_server_is_offered_on_the_next_turn(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    record = tmp_path / "kit"
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("kit__grow", {}, id="toolu_grow")]),
        Reply(text="Grown."),
        Reply(tool_uses=[ToolUse("kit__late", {"x": "one"}, id="toolu_late")]),
        Reply(text="Used the new tool."),
    )
    api = await start(api_factory, fake_anthropic, monkeypatch, stdio_kit(record))
    assert "kit__late" not in await tool_names(api)
    accepted = await send(api.node, AGENT, "grow")
    events = await wait_end(api.node, accepted.turn_id)
    assert end_of(events).reason == "final"
    assert results(events)["toolu_grow"].output == "grew: late"
    assert "kit__late" not in offered(fake_anthropic, 0)
    # The server is listed again once it said its tools changed; the agent is rebuilt then.
    await until(lambda: len(lines(record / "lists.log")) >= 2, "the tools to be listed again")
    await until(lambda: _has_tool(api, "kit__late"), "the agent to offer kit__late")
    follow = await send(api.node, AGENT, "use the new tool")
    events = await wait_end(api.node, follow.turn_id)
    assert end_of(events).reason == "final"
    assert "kit__late" in offered(fake_anthropic, 2)
    assert results(events)["toolu_late"].output == "late one"
    assert len(lines(record / "pids.log")) == 1  # the same session, no restart


# --- h. an allowlist ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_allowlist_offers_only_the_tools_it_names(
    api_factory: ApiFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    fake_anthropic.script(Reply(text="Only echo."))
    servers = stdio_kit(tmp_path / "kit", extra="\n    tools: [echo]")
    api = await start(api_factory, fake_anthropic, monkeypatch, servers)
    assert [n for n in await tool_names(api) if n.startswith("kit__")] == ["kit__echo"]
    accepted = await send(api.node, AGENT, "what can you do?")
    assert end_of(await wait_end(api.node, accepted.turn_id)).reason == "final"
    assert [n for n in offered(fake_anthropic, 0) if n.startswith("kit__")] == ["kit__echo"]


# --- errors at load ----------------------------------------------------------------------------

BAD_SERVERS = [
    pytest.param("""
  - {name: kit, command: /bin/true}
  - {name: kit, url: "http://127.0.0.1:1/mcp"}""", "twice", id="same-name"),
    pytest.param("""
  - {name: kit, command: /bin/true, url: "http://127.0.0.1:1/mcp"}""", "exactly one",
                 id="command-and-url"),
    pytest.param("""
  - {name: kit}""", "exactly one", id="neither"),
    pytest.param("""
  - {name: kit, command: /bin/true, env: {KIT_TOKEN: "${DISPACH_TEST_NO_SUCH_VAR}"}}""",
                 "DISPACH_TEST_NO_SUCH_VAR", id="unknown-var-in-env"),
    pytest.param("""
  - name: web
    url: "http://127.0.0.1:1/mcp"
    headers: {Authorization: "Bearer ${DISPACH_TEST_NO_SUCH_VAR}"}""",
                 "DISPACH_TEST_NO_SUCH_VAR", id="unknown-var-in-headers"),
]  # fmt: skip


@pytest.mark.asyncio
@pytest.mark.parametrize(("declared", "words"), BAD_SERVERS)
async def test_an_invalid_mcp_server_declaration_stops_the_node_from_starting(
    node_factory: NodeFactory,
    fake_anthropic: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    declared: str,
    words: str,
) -> None:
    monkeypatch.setenv(KEY_ENV, "test-key")
    monkeypatch.delenv("DISPACH_TEST_NO_SUCH_VAR", raising=False)
    node_factory.write_agent(AGENT, manifest(fake_anthropic, declared))
    # Started by hand (the factory keeps only nodes that started): stop() cleans up whatever
    # start() reached.
    node = Node(settings_of(node_factory))
    try:
        with pytest.raises(ManifestError) as raised:
            await asyncio.wait_for(node.start(), 30)
    finally:
        await node.stop()
    assert raised.value.code == "invalid_manifest"
    assert words in raised.value.message and raised.value.hint, raised.value
