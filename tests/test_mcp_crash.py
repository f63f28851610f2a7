"""Kill -9 of a ``dispach serve`` node while two tools of an MCP server run, then a restart: the
turn resumes from its log and ends once; the destructive tool (``destructiveHint``) is reported
uncertain and never sent again, the read-only one (``readOnlyHint``) is simply run again."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
from pathlib import Path

import nats
import pytest

from actors.turn.core import attempts
from eventstore import EventStore, subjects
from eventstore.catalogue import ToolResult, TurnEnd
from tests import fakes
from tests.conftest import ROOT, Servers
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.test_turn_crash import accept_when_serving, resumed, serve, serve_env, wait_for

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
mcp_servers:
  - name: kit
    command: {python}
    args: ["-m", "tests.mcp_servers.kit", "--record", "{record}"]
    cwd: {root}
"""


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


async def _dead(pid: int) -> bool:
    """No such process, or only its zombie (nobody may reap it in a container)."""
    try:
        stat = await asyncio.to_thread(Path(f"/proc/{pid}/stat").read_text)
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def end_kits(record: Path) -> None:
    """Kill the kit processes this test's nodes started (by the pids they recorded) that
    outlived their node."""
    for pid in lines(record / "pids.log"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@pytest.mark.asyncio
async def test_kill_9_during_two_mcp_calls_then_restart(
    servers: Servers, schema: str, tmp_path: Path, fake_anthropic: FakeAnthropic
) -> None:
    record = tmp_path / "kit"
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "crashy.yaml").write_text(MANIFEST.format(
        url=fake_anthropic.url, python=sys.executable, record=record, root=ROOT
    ))  # fmt: skip
    fake_anthropic.script(
        Reply(tool_uses=[
            ToolUse("kit__write", {"path": "report.txt", "seconds": 30}, id="toolu_w"),
            ToolUse("kit__read", {"seconds": 8}, id="toolu_r"),
        ]),
        Reply(text="finished after the crash"),
    )  # fmt: skip
    env = serve_env(servers, schema, tmp_path, agents)
    log = tmp_path / "serve.log"
    subjects.use(schema)  # this test's deployment, as its node names it (DISPACH_CLUSTER)
    first = serve(env, log)
    nc = await nats.connect(servers.nats_url)
    store = EventStore(servers.database_url, schema=schema)
    try:
        accepted = await accept_when_serving(nc, "crashy", "write and read", log)

        async def both_started() -> bool:
            return len(lines(record / "write.log")) == 1 and len(lines(record / "read.log")) == 1

        await wait_for(both_started, 30, "both tools to start")
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait, 10)
        (first_kit,) = lines(record / "pids.log")
        # The killed node's MCP server does not outlive it (it dies with its parent).
        await wait_for(functools.partial(_dead, int(first_kit)), 10, "the first node's kit to end")

        events = await resumed(env, log, store, accepted.turn_id)
    finally:
        if first.poll() is None:
            first.kill()
        await nc.close()
        await store.aclose()
        end_kits(record)

    kits = lines(record / "pids.log")
    assert len(kits) == 2 and kits[0] == first_kit, kits  # the second node started its own
    ends = [e.data for e in events if isinstance(e.data, TurnEnd)]
    assert len(ends) == 1
    assert ends[0].reason == "final" and ends[0].text == "finished after the crash"
    tried = [a.attempt for a in attempts(e.data for e in events)]
    assert tried == [1, 2]
    found = {e.data.call_id: e.data for e in events if isinstance(e.data, ToolResult)}
    assert set(found) == {"toolu_w", "toolu_r"}, found

    assert len(lines(record / "write.log")) == 1, "a destructive MCP tool must not run twice"
    wrote = found["toolu_w"]
    assert wrote.uncertain and not wrote.ok, wrote
    assert (wrote.source, wrote.mcp_server) == ("mcp", "kit")  # the log still says where it ran

    assert len(lines(record / "read.log")) == 2, "a read-only MCP tool is simply run again"
    assert lines(record / "read.log")[1] == kits[1]  # by the restarted server
    read = found["toolu_r"]
    assert read.ok and read.output == "read", read
    assert read.source == "mcp" and read.mcp_server == "kit"

    sent = fake_anthropic.message_requests()[-1].body["messages"][-1]["content"]
    by_id = {b["tool_use_id"]: b for b in sent if b["type"] == "tool_result"}
    assert "uncertain" in str(by_id["toolu_w"]["content"])
    assert str(by_id["toolu_r"]["content"]) == "read"
    # The result the resumed turn writes for the call it will not send again is still the
    # result of an MCP tool (docs: tool.result gains source and mcpServer for MCP tools).
    assert (wrote.source, wrote.mcp_server) == ("mcp", "kit"), wrote
