"""Session actors keep their history in memory: idle ones are passivated, and a crowd of sessions
does not stay a crowd of actors (nor of threads: session and turn actors run on the event loop)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.conftest import NodeFactory
from tests.turns import send, wait_end


@pytest.mark.asyncio
async def test_many_sessions_do_not_keep_an_actor_each(node_factory: NodeFactory) -> None:
    node = await node_factory.start(max_sessions=8, session_idle_seconds=60.0)
    before = threading.active_count()
    for i in range(40):
        accepted = await send(node, "assistant", "hello", session=f"crowd-{i}")
        await wait_end(node, accepted.turn_id)
    engine = node.engine
    assert engine is not None

    async def settled() -> None:
        while len(engine.live_sessions()) > 8:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(settled(), 15)
    assert threading.active_count() <= before + 8 + 2  # a few TurnActors may still be winding down
    again = await send(node, "assistant", "still there?", session="crowd-0")  # reactivates
    events = await wait_end(node, again.turn_id)
    assert events[-1].type == "turn.end"


@pytest.mark.asyncio
async def test_an_idle_session_is_passivated_and_comes_back(node_factory: NodeFactory) -> None:
    node = await node_factory.start(session_idle_seconds=1.0)
    accepted = await send(node, "assistant", "hello", session="sleepy")
    await wait_end(node, accepted.turn_id)
    engine = node.engine
    assert engine is not None

    async def passivated() -> None:
        while ("assistant", "sleepy") in engine.live_sessions():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(passivated(), 10)
    again = await send(node, "assistant", "and again", session="sleepy")
    assert (await wait_end(node, again.turn_id))[-1].type == "turn.end"
