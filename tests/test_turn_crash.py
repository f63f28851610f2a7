"""Kill -9 of a node in the middle of a tool call, then a restart: the turn resumes from its
log and ends exactly once; a mutating tool is never run twice (it is reported as uncertain),
a read-only one is simply run again."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
import pytest

from actors.messages import Accepted
from actors.turn.core import attempts
from eventstore import EventStore, RecordedEvent, streams, subjects
from eventstore.catalogue import ToolCall, ToolResult, TurnEnd
from gateways.ingress import IngressMessage, request
from tests import fakes
from tests.conftest import ROOT, Servers
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.test_node import free_port

fake_anthropic = fakes.fake_anthropic
DISPACH = str(Path(sys.executable).parent / "dispach")
pytestmark = pytest.mark.slow

MANIFEST = """
id: crashy
model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {url}
  api_key_env: DISPACH_TEST_ANTHROPIC_KEY
tools:
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran, then waits.
    mutating: {mutating}
    input_schema:
      type: object
      properties:
        path: {{type: string}}
        seconds: {{type: number}}
      required: [path]
"""


def serve(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([DISPACH, "serve"], env=env, stdout=out, stderr=subprocess.STDOUT)


def serve_env(servers: Servers, schema: str, tmp_path: Path, agents: Path) -> dict[str, str]:
    """The environment of a ``dispach serve`` of this test: its schema and deployment, its
    home and agents under ``tmp_path``, a free port, the fake Anthropic's test key."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")} | {
        "DATABASE_URL": servers.database_url,
        "NATS_URL": servers.nats_url,
        "DISPACH_DB_SCHEMA": schema,
        "DISPACH_CLUSTER": schema,
        "DISPACH_HOME": str(tmp_path / "home"),
        "DISPACH_AGENTS": str(agents),
        "DISPACH_PORT": str(free_port()),
        "DISPACH_TEST_ANTHROPIC_KEY": "test",
        "DISPACH_LOG_FORMAT": "json",
        "PYTHONPATH": str(ROOT),
    }


async def accept_when_serving(nc: Any, agent: str, text: str, log: Path) -> Accepted:
    """Send ``text`` over NATS until the starting node accepts it."""
    for _ in range(200):
        result = await request(nc, agent, IngressMessage(text=text), timeout=2)
        if isinstance(result, Accepted):
            return result
        assert result.code in ("no_node", "agent_not_found", "accept_timeout"), result
        await asyncio.sleep(0.1)
    served = await asyncio.to_thread(log.read_text)
    raise AssertionError(f"the node never accepted a message:\n{served}")


async def resumed(
    env: dict[str, str], log: Path, store: EventStore, turn_id: str
) -> list[RecordedEvent]:
    """Start the node again, wait for the turn it resumes to end, stop the node cleanly; the
    turn's events."""
    second = serve(env, log)
    try:
        await store.aopen()
        stream = streams.turn(turn_id)

        async def ended() -> bool:
            return any(isinstance(e.data, TurnEnd) for e in await store.aread_stream(stream))

        await wait_for(ended, 60, "the resumed turn to end")
        return await store.aread_stream(stream)
    finally:
        second.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(second.wait, 30)
        assert code == 0, (await asyncio.to_thread(log.read_text))[-3000:]


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
@pytest.mark.parametrize("mutating", [True, False], ids=["mutating", "read-only"])
async def test_kill_9_during_a_tool_call_then_restart(
    servers: Servers, schema: str, tmp_path: Path, fake_anthropic: FakeAnthropic, mutating: bool
) -> None:
    marker = tmp_path / "runs.txt"
    marker.touch()
    agents = tmp_path / "agents"
    agents.mkdir()
    manifest = MANIFEST.format(url=fake_anthropic.url, mutating=str(mutating).lower())
    (agents / "crashy.yaml").write_text(manifest)
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("record", {"path": str(marker), "seconds": 20}, id="toolu_r")]),
        Reply(text="finished after the crash"),
    )
    env = serve_env(servers, schema, tmp_path, agents)
    log = tmp_path / "serve.log"
    subjects.use(schema)  # this test's deployment, as its node names it (DISPACH_CLUSTER)
    first = serve(env, log)
    nc = await nats.connect(servers.nats_url)
    store = EventStore(servers.database_url, schema=schema)
    try:
        accepted = await accept_when_serving(nc, "crashy", "record it", log)

        async def started() -> bool:
            return marker.read_text().count("ran") == 1

        await wait_for(started, 30, "the tool to start")
        # A read-only call's tool.call is sent, not awaited, before it runs: a kill before it
        # commits resumes by asking the model again, a different test. Kill once it is in.
        probe = EventStore(servers.database_url, schema=schema)
        await probe.aopen()
        stream = streams.turn(accepted.turn_id)

        async def recorded() -> bool:
            return any(isinstance(e.data, ToolCall) for e in await probe.aread_stream(stream))

        try:
            await wait_for(recorded, 30, "the tool call to be recorded")
        finally:
            await probe.aclose()
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait, 10)

        events = await resumed(env, log, store, accepted.turn_id)
    finally:
        if first.poll() is None:
            first.kill()
        await nc.close()
        await store.aclose()

    ends = [e.data for e in events if isinstance(e.data, TurnEnd)]
    assert len(ends) == 1
    assert ends[0].reason == "final"
    assert ends[0].text == "finished after the crash"
    tried = [a.attempt for a in attempts(e.data for e in events)]
    assert tried == [1, 2]
    [tool_result] = [e.data for e in events if isinstance(e.data, ToolResult)]
    runs = marker.read_text().count("ran")
    if mutating:
        assert runs == 1, "a mutating tool must not run twice"
        assert tool_result.uncertain
        assert not tool_result.ok
        sent = fake_anthropic.message_requests()[-1].body["messages"][-1]["content"][0]
        assert sent["tool_use_id"] == "toolu_r" and "uncertain" in sent["content"]
    else:
        assert runs == 2, "a read-only tool is simply run again"
        assert tool_result.ok
        assert tool_result.output == "recorded"
