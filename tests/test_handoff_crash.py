"""Kill -9 of a node while a member of a team runs its turn, then a restart: the member's turn
resumes like any turn (its mutating tool, cut short, is reported uncertain, never run again),
and the supervisor's handoff call, run again on resume, waits for that same member turn
instead of starting another: one handoff.start, one member turn, one handoff.result."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import nats
import pytest

from actors import ids
from actors.handoff.plan import round_key
from actors.turn.core import attempts
from eventstore import EventStore, RecordedEvent, streams, subjects
from eventstore.catalogue import HandoffResult, HandoffStart, ToolCall, ToolResult, TurnEnd
from tests import fakes
from tests.conftest import Servers
from tests.fakes import FakeAnthropic, Reply, ToolUse
from tests.test_turn_crash import accept_when_serving, serve, serve_env, wait_for

fake_anthropic = fakes.fake_anthropic
pytestmark = pytest.mark.slow

MODEL = """model:
  provider: anthropic
  id: claude-sonnet-5
  base_url: {url}
  api_key_env: DISPACH_TEST_ANTHROPIC_KEY
"""
BOSS = """id: boss
{model}members:
  recorder:
    description: Records things.
    artifact:
      type: object
      properties: {{done: {{type: boolean}}}}
      required: [done]
"""
RECORDER = """id: recorder
{model}tools:
  - name: record
    module: tests.fixtures_tools:record_and_wait
    description: Records that it ran, then waits.
    mutating: true
    input_schema:
      type: object
      properties:
        path: {{type: string}}
        seconds: {{type: number}}
      required: [path]
"""


@pytest.mark.asyncio
async def test_kill_9_during_the_members_turn_resumes_it_and_the_handoff_runs_once(
    servers: Servers, schema: str, tmp_path: Path, fake_anthropic: FakeAnthropic
) -> None:
    marker = tmp_path / "runs.txt"
    marker.touch()
    agents = tmp_path / "agents"
    agents.mkdir()
    model = MODEL.format(url=fake_anthropic.url)
    (agents / "boss.yaml").write_text(BOSS.format(model=model))
    (agents / "recorder.yaml").write_text(RECORDER.format(model=model))
    task = {"member": "recorder", "task": "record it"}
    fake_anthropic.script(
        Reply(tool_uses=[ToolUse("handoff", task, id="toolu_h")]),
        Reply(tool_uses=[ToolUse("record", {"path": str(marker), "seconds": 30}, id="toolu_r")]),
        Reply(text='{"done": true}'),
        Reply(text="recorded, after the crash"),
    )
    env = serve_env(servers, schema, tmp_path, agents)
    log = tmp_path / "serve.log"
    subjects.use(schema)
    first = serve(env, log)
    nc = await nats.connect(servers.nats_url)
    store = EventStore(servers.database_url, schema=schema)
    try:
        accepted = await accept_when_serving(nc, "boss", "record it, through your team", log)
        parent = accepted.turn_id
        member_turn = ids.keyed_turn_id("recorder", round_key(parent, "toolu_h", 1))

        async def running() -> bool:  # the member's mutating call is committed before it runs
            return marker.read_text().count("ran") == 1

        await wait_for(running, 90, "the member's tool to start")
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait, 10)

        second = serve(env, log)
        try:
            await store.aopen()

            async def ended() -> bool:
                events = await store.aread_stream(streams.turn(parent))
                return any(isinstance(e.data, TurnEnd) for e in events)

            await wait_for(ended, 150, "the resumed supervisor turn to end")
            events = await store.aread_stream(streams.turn(parent))
            member = await store.aread_stream(streams.turn(member_turn))
            repair = await store.aread_stream(
                streams.turn(ids.keyed_turn_id("recorder", round_key(parent, "toolu_h", 2)))
            )
        finally:
            second.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(second.wait, 60)
            assert code == 0, (await asyncio.to_thread(log.read_text))[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
        await nc.close()
        await store.aclose()

    def of(stream: list[RecordedEvent], kind: type) -> list[object]:
        return [e.data for e in stream if isinstance(e.data, kind)]

    assert marker.read_text().count("ran") == 1, "the member's tool must not run twice"
    # The member's turn resumed from its log, its cut-short call reported uncertain.
    assert [a.attempt for a in attempts(e.data for e in member)] == [1, 2]
    [member_result] = of(member, ToolResult)
    assert isinstance(member_result, ToolResult) and member_result.uncertain
    assert [c.slug for c in of(member, ToolCall) if isinstance(c, ToolCall)] == ["record"]
    [member_end] = of(member, TurnEnd)
    assert isinstance(member_end, TurnEnd) and member_end.reason == "final"
    # The supervisor's handoff, run again on resume, found the member turn it had started.
    assert [a.attempt for a in attempts(e.data for e in events)] == [1, 2]
    [start] = of(events, HandoffStart)
    [result] = of(events, HandoffResult)
    assert isinstance(start, HandoffStart) and start.turn_id == member_turn
    assert isinstance(result, HandoffResult)
    assert result.outcome == "ok" and result.turn_ids == [member_turn] and not result.repaired
    assert repair == [], "no second member turn"
    handed = [r for r in of(events, ToolResult) if isinstance(r, ToolResult)]
    assert [(r.slug, r.ok) for r in handed] == [("handoff", True)]
    assert '{"done":true}' in (handed[0].output or "")
    [end] = of(events, TurnEnd)
    assert isinstance(end, TurnEnd) and end.reason == "final"
    assert end.text == "recorded, after the crash"
    assert len(fake_anthropic.message_requests()) == 4  # no model call was made twice
