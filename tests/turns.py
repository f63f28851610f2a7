"""Helpers for turn tests: submit over NATS like an internal producer, wait for the end."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.messages import Accepted, Refused, StopResult, StopTurn
from eventstore import START, EventStore, RecordedEvent, streams
from gateways.ingress import IngressMessage, request
from runtime.node import Node


async def send(node: Node, agent: str, text: str, session: str = "api:default",
               **extra: Any) -> Accepted:  # fmt: skip
    assert node.nc is not None
    result = await request(node.nc, agent, IngressMessage(text=text, session_key=session, **extra))
    assert isinstance(result, Accepted), result
    return result


async def refused(node: Node, agent: str, text: str, **extra: Any) -> Refused:
    assert node.nc is not None
    result = await request(node.nc, agent, IngressMessage(text=text, **extra))
    assert isinstance(result, Refused), result
    return result


async def stop(node: Node, turn_id: str, by: str = "test") -> StopResult:
    """Stop a turn through the node's command path (as the HTTP and WebSocket doors do)."""
    assert node.commands is not None
    result = await node.commands.stop(StopTurn(turn_id=turn_id, by=by))
    assert isinstance(result, StopResult), result
    return result


def store_of(node: Node) -> EventStore:
    assert node.store is not None, "the node is not started"
    return node.store


async def wait_end(node: Node, turn_id: str, timeout: float = 30.0) -> list[RecordedEvent]:
    """Every event of the turn once its ``turn.end`` is stored."""
    store = store_of(node)

    async def ended() -> list[RecordedEvent]:
        async for event in store.subscribe(START, where=lambda e: e.type == "turn.end"):
            if event.metadata.turn_id == turn_id:
                return await store.aread_stream(streams.turn(turn_id))
        raise AssertionError("unreachable")

    return await asyncio.wait_for(ended(), timeout)


def types(events: list[RecordedEvent]) -> list[str]:
    return [e.type for e in events]


async def turn_row(node: Node, turn_id: str) -> dict[str, Any]:
    async with store_of(node).apool.connection() as conn:
        cur = await conn.execute(b"SELECT * FROM turns WHERE turn_id = %s", [turn_id])
        row = await cur.fetchone()
        assert row is not None and cur.description is not None
        return {d.name: v for d, v in zip(cur.description, row, strict=True)}
