"""A turn resumed after a whole-cluster restart runs on the agent version it started with, even
when a reload changed the manifest in between (issue 36): a real ``dispach serve`` runs a turn
on v1, the file is changed to v2 and reloaded while the turn is in its tool, the node is killed
-9 and started again on a disk that holds v2. The resumed turn's next model call is v1's, built
from the text the reload recorded of the version it replaced; a new turn runs v2."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import nats
import pytest

from eventstore import EventStore, streams, subjects
from eventstore.catalogue import AgentReloaded, ModelCall, ToolCall, TurnEnd
from runtime.manifest import version_of
from tests.conftest import Servers
from tests.test_turn_crash import accept_when_serving, resumed, serve, serve_env, wait_for

pytestmark = pytest.mark.slow


def manifest(version: str, path: Path) -> str:
    return f"""
id: versioned
model:
  provider: scripted
  id: model-{version}
  script:
    - {{match: "^slow", tool: record, input: {{path: "{path}", seconds: 4}}}}
    - {{match: ".*", reply: "{version} says {{0}}"}}
tools:
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran, then waits.
    mutating: false
    input_schema: {{type: object}}
"""


@pytest.mark.asyncio
async def test_a_turn_resumed_after_a_cluster_restart_runs_on_the_version_it_began_with(
    servers: Servers, schema: str, tmp_path: Path
) -> None:
    marker = tmp_path / "runs.txt"
    agents = tmp_path / "agents"
    agents.mkdir()
    v1, v2 = manifest("v1", marker), manifest("v2", marker)
    (agents / "versioned.yaml").write_text(v1)
    env = serve_env(servers, schema, tmp_path, agents)
    log = tmp_path / "serve.log"
    subjects.use(schema)
    first = serve(env, log)
    nc = await nats.connect(servers.nats_url)
    store = EventStore(servers.database_url, schema=schema)  # opened by resumed()
    probe = EventStore(servers.database_url, schema=schema)
    await probe.aopen()
    try:
        accepted = await accept_when_serving(nc, "versioned", "slow one", log)
        stream = streams.turn(accepted.turn_id)

        async def in_its_tool() -> bool:
            called = any(isinstance(e.data, ToolCall) for e in await probe.aread_stream(stream))
            return called and marker.exists() and marker.read_text().count("ran") == 1

        await wait_for(in_its_tool, 30, "the turn to be in its tool")
        (agents / "versioned.yaml").write_text(v2)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{env['DISPACH_PORT']}") as http:
            reloaded = await http.post("/v1/agents/versioned/reload")
        assert reloaded.status_code == 200, reloaded.text
        assert reloaded.json()["version"] == version_of(v2.encode())
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait, 10)
        assert not any(isinstance(e.data, TurnEnd) for e in await probe.aread_stream(stream))
        await probe.aclose()

        events = await resumed(env, log, store, accepted.turn_id)
        recorded = [e.data for e in await store.aread_stream(streams.agent("versioned"))]
    finally:
        if first.poll() is None:
            first.kill()
        await probe.aclose()
        await nc.close()
        await store.aclose()

    old, new = version_of(v1.encode()), version_of(v2.encode())
    calls = [e.data for e in events if isinstance(e.data, ModelCall)]
    assert [c.agent_version for c in calls] == [old, old], "resumed on the version it began with"
    [end] = [e.data for e in events if isinstance(e.data, TurnEnd)]
    assert end.reason == "final"
    [reload] = recorded
    assert isinstance(reload, AgentReloaded)
    assert (reload.version, reload.previous) == (new, old)
    assert reload.manifest == v2 and reload.previous_manifest == v1
    served = log.read_text()
    assert "agent_version_rebuilt" in served and "turn_version_unavailable" not in served
