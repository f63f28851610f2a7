"""Kill -9 of a node while a turn waits for a person's approval, then a restart: the wait is in
the log, not in the dead process. The new node lists the same approval; a grant runs the tool
exactly once, a denial never runs it, and either way the turn ends exactly once.

The nodes are real ``dispach serve`` processes (see test_delivery_crash.Cluster) on the test's
schema; the parked turn holds no thread, so the kill lands while nothing of it is running.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from actors.turn.core import attempts
from eventstore import RecordedEvent, streams
from eventstore.catalogue import (
    ApprovalRequested,
    ApprovalResolved,
    ToolCall,
    ToolResult,
    TurnEnd,
)
from tests import test_approvals, test_delivery_crash
from tests.test_delivery_crash import Cluster

cluster = test_delivery_crash.cluster  # the fixture: nodes on the test's schema, killed at the end
pytestmark = pytest.mark.slow

AGENT = "careful"
MANIFEST = test_approvals.CAREFUL  # the same agent as the in-process approval tests


async def approvals(cluster: Cluster) -> list[dict[str, Any]]:
    """The agent's pending approvals, once there is at least one."""
    found: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=cluster.url) as client:

        async def listed() -> bool:
            found[:] = (await client.get(f"/v1/agents/{AGENT}/approvals")).json()["approvals"]
            return bool(found)

        await cluster.wait(listed, 15, "an approval to be pending")
    return found


async def answer(cluster: Cluster, approval_id: str, granted: bool) -> None:
    """Answer the approval; ``approval_busy`` (the new node still restoring the turn) is retried."""
    deadline = time.monotonic() + 10
    async with httpx.AsyncClient(base_url=cluster.url) as client:
        while True:
            r = await client.post(f"/v1/agents/{AGENT}/approvals/{approval_id}",
                                  json={"granted": granted}, timeout=5)  # fmt: skip
            busy = r.status_code == 409 and r.json()["error"]["code"] == "approval_busy"
            if not busy or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    assert r.status_code == 200, (r.status_code, r.text, cluster.tail())
    assert r.json() == {"approvalId": approval_id, "granted": granted}


async def park_then_kill(cluster: Cluster, ran: Path) -> tuple[str, str]:
    """A turn parked on the ``ask`` tool, its node killed by SIGKILL, a new node ready on the
    same schema. Returns the turn id and the approval id (the same on both nodes)."""
    cluster.write_agent(AGENT, MANIFEST.format(path=ran, timeout=600))
    first = await cluster.start()
    async with httpx.AsyncClient(base_url=cluster.url) as client:
        r = await client.post(f"/v1/agents/{AGENT}/messages", json={"text": "record it"})
        assert r.status_code == 202, r.text
        turn_id: str = r.json()["turnId"]
        (before,) = await approvals(cluster)
        assert (before["turnId"], before["slug"]) == (turn_id, "record")
        parked = (await client.get(f"/v1/turns/{turn_id}")).json()
        assert (parked["status"], parked["state"]) == ("running", "awaiting_approval")
    assert not await asyncio.to_thread(ran.exists), "nothing runs before the answer"

    os.kill(first.pid, signal.SIGKILL)
    code = await asyncio.to_thread(first.wait, 10)
    assert code == -signal.SIGKILL

    await cluster.start()
    (after,) = await approvals(cluster)
    assert after["approvalId"] == before["approvalId"], (before, after)
    assert after["turnId"] == turn_id
    return turn_id, before["approvalId"]


async def ended(cluster: Cluster, turn_id: str) -> list[RecordedEvent]:
    """The turn's stream once it holds a turn.end."""
    stream = streams.turn(turn_id)

    async def done() -> bool:
        return any(isinstance(e.data, TurnEnd) for e in await cluster.store.aread_stream(stream))

    await cluster.wait(done, 15, "the turn to end")
    return await cluster.store.aread_stream(stream)


def of(events: list[RecordedEvent], kind: type[Any]) -> list[Any]:
    return [e.data for e in events if isinstance(e.data, kind)]


async def settle(cluster: Cluster) -> None:
    """Nothing is left pending, and the last node stops on SIGTERM with exit 0 (nothing left
    hanging by the resumed turn)."""
    async with httpx.AsyncClient(base_url=cluster.url) as client:
        left = (await client.get(f"/v1/agents/{AGENT}/approvals")).json()["approvals"]
    assert left == [], left
    await cluster.stop(cluster.procs[-1])


@pytest.mark.asyncio
async def test_a_grant_after_kill_9_runs_the_tool_once(cluster: Cluster, tmp_path: Path) -> None:
    ran = tmp_path / "ran.txt"
    turn_id, approval_id = await park_then_kill(cluster, ran)

    await answer(cluster, approval_id, granted=True)
    events = await ended(cluster, turn_id)
    await settle(cluster)

    (end,) = of(events, TurnEnd)
    assert end.reason == "final", cluster.tail()
    assert ran.read_text() == "ran\n", "the granted tool ran exactly once"
    assert [a.attempt for a in attempts(e.data for e in events)] == [1, 2], (
        "resumed on the new node"
    )
    assert len(of(events, ToolCall)) == 1
    (result,) = of(events, ToolResult)
    assert result.ok and not result.refused and not result.uncertain
    assert [r.approval_id for r in of(events, ApprovalRequested)] == [approval_id]
    assert [(r.granted, r.approval_id) for r in of(events, ApprovalResolved)] == [
        (True, approval_id)
    ]


@pytest.mark.asyncio
async def test_a_denial_after_kill_9_never_runs_the_tool(cluster: Cluster, tmp_path: Path) -> None:
    ran = tmp_path / "ran.txt"
    turn_id, approval_id = await park_then_kill(cluster, ran)

    await answer(cluster, approval_id, granted=False)
    events = await ended(cluster, turn_id)
    await settle(cluster)

    (end,) = of(events, TurnEnd)
    assert end.reason == "final", cluster.tail()
    assert not ran.exists(), "a denied tool never runs"
    assert [a.attempt for a in attempts(e.data for e in events)] == [1, 2], (
        "resumed on the new node"
    )
    assert of(events, ToolCall) == []
    (result,) = of(events, ToolResult)
    assert result.refused and not result.ok and "denied" in (result.output or "")
    assert [(r.granted, r.approval_id) for r in of(events, ApprovalResolved)] == [
        (False, approval_id)
    ]
