"""Projections: maintained live (inline and asynchronous) equal rebuilt from the log."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

from eventstore import (
    ASYNC,
    INLINE,
    EventStore,
    Metadata,
    NewEvent,
    ProjectionRunner,
    SessionsProjection,
    TurnsProjection,
    rebuild,
)
from eventstore.catalogue import (
    ApprovalRequested,
    ApprovalResolved,
    ErrorDetail,
    ModelResult,
    SessionCleared,
    Tokens,
    TurnAttempt,
    TurnEnd,
    TurnStart,
)
from eventstore.event import Event
from tests.conftest import ConnectFactory, Servers
from tests.storeops import append


@pytest.fixture
def store(servers: Servers, schema: str) -> Iterator[EventStore]:
    """A store that maintains `sessions` asynchronously: the node keeps every projection inline
    today, and these tests exercise the ProjectionRunner with `sessions` as its projection."""
    store = EventStore(servers.database_url, schema=schema,
                       inline=[p for p in INLINE if p.name != "sessions"])  # fmt: skip
    store.open()
    try:
        yield store
    finally:
        store.close()


def snapshot(connect: ConnectFactory, table: str, key: str) -> list[tuple[Any, ...]]:
    with connect() as conn:
        return conn.execute(f"SELECT * FROM {table} ORDER BY {key}".encode()).fetchall()


def a_turn(rng: random.Random, n: int) -> tuple[str, list[NewEvent]]:
    turn_id = f"t_{n}"
    meta = Metadata(
        agent_id=rng.choice(["a", "b"]), session_key=f"s{rng.randint(0, 4)}", turn_id=turn_id
    )
    events: list[Event] = [
        TurnStart(source="api", input=f"question {n}"),
        TurnAttempt(attempt=1, node="n1"),
    ]
    for _ in range(rng.randint(0, 3)):
        if rng.random() < 0.2:
            events += [
                ApprovalRequested(
                    approval_id="ap", slug="x", call_id="c", mutating=True, reason="ask"
                ),
                ApprovalResolved(approval_id="ap", slug="x", granted=True, by="approver"),
            ]
        events.append(
            ModelResult(
                output_tokens=rng.randint(1, 99),
                prompt_tokens=rng.randint(100, 999),
                finish_reason="end_turn",
                latency_ms=5,
                cache_read_tokens=rng.randint(0, 9),
            )
        )
    if rng.random() < 0.8:
        error = (
            ErrorDetail(code="model_error", message="m", hint="h") if rng.random() < 0.3 else None
        )
        events.append(
            TurnEnd(
                reason="error" if error else "final",
                steps=3,
                tokens=Tokens(prompt=5, output=6),
                duration_ms=rng.randint(1, 999),
                text="answer",
                error=error,
            )
        )
    return f"turn-{turn_id}", [NewEvent(event=e, metadata=meta) for e in events]  # fmt: skip


@pytest.mark.asyncio
async def test_a_rebuilt_projection_equals_the_live_one(
    store: EventStore, connect: ConnectFactory
) -> None:
    seed = int(os.environ.get("DISPACH_SEED") or random.randrange(2**32))
    print(f"DISPACH_SEED={seed}")
    rng = random.Random(seed)
    await store.apool.open()
    runner = ProjectionRunner(store, SessionsProjection(), batch=rng.randint(5, 50))
    for n in range(120):
        stream, events = a_turn(rng, n)
        cut = rng.randint(1, len(events))  # a turn's events arrive over several appends
        await store.aappend(stream, events[:cut])
        if cut < len(events):
            await store.aappend(stream, events[cut:])
        if rng.random() < 0.05:
            meta = Metadata(agent_id="a", session_key=f"s{rng.randint(0, 4)}")
            await store.aappend(
                "session-a-x", [NewEvent(event=SessionCleared(by="test"), metadata=meta)]
            )
        if rng.random() < 0.2:
            await runner.catch_up()
    await runner.catch_up()
    live_turns = snapshot(connect, "turns", "turn_id")
    live_sessions = snapshot(connect, "sessions", "agent_id, session_key")
    assert len(live_turns) == 120 and live_sessions

    def rebuild_both() -> None:
        rebuild(store, TurnsProjection(), inline=True)
        rebuild(store, SessionsProjection(), inline=False)

    await asyncio.to_thread(rebuild_both)
    # The asynchronous one is rebuilt to the head, its checkpoint with it: nothing is left to do.
    assert await ProjectionRunner(store, SessionsProjection()).catch_up() == 0
    assert snapshot(connect, "turns", "turn_id") == live_turns, f"DISPACH_SEED={seed}"
    assert snapshot(connect, "sessions", "agent_id, session_key") == live_sessions
    await store.apool.close()


def test_the_turn_resource_follows_the_turn(store: EventStore, connect: ConnectFactory) -> None:
    meta = Metadata(agent_id="a", session_key="api:default", turn_id="t_9")
    append(store, "turn-t_9", [NewEvent(event=TurnStart(source="api", input="hi"), metadata=meta)])
    [row] = snapshot(connect, "turns", "turn_id")
    assert row[5:7] == ("running", "accepted")
    append(store, "turn-t_9", [
        NewEvent(event=ModelResult(output_tokens=7, prompt_tokens=70, finish_reason="end_turn",
                                   latency_ms=3), metadata=meta),
        NewEvent(event=TurnEnd(reason="max_steps", steps=1, tokens=Tokens(prompt=70, output=7),
                               duration_ms=9, text="partial"), metadata=meta),
    ])  # fmt: skip
    with connect() as conn:
        status, state, steps, text, duration = (
            conn.execute(
                "SELECT status, state, steps, text, duration_ms FROM turns WHERE turn_id = 't_9'"
            ).fetchone()
            or ()
        )
    assert (status, state, steps, text, duration) == ("max_steps", "ended", 1, "partial", 9)


@pytest.mark.asyncio
async def test_two_runners_apply_each_batch_once(
    store: EventStore, connect: ConnectFactory
) -> None:
    await store.apool.open()
    rng = random.Random(7)
    for n in range(60):
        stream, events = a_turn(rng, n)
        await store.aappend(stream, events)
    one, two = (ProjectionRunner(store, SessionsProjection(), batch=7) for _ in range(2))
    await asyncio.gather(one.catch_up(), two.catch_up())
    racing = snapshot(connect, "sessions", "agent_id, session_key")

    def reset() -> None:
        rebuild(store, SessionsProjection(), inline=False)

    await asyncio.to_thread(reset)
    # A running runner notices the reset when it next verifies its checkpoint (at most every
    # persist_every seconds; here at once).
    alert = ProjectionRunner(store, SessionsProjection(), batch=7, persist_every=0.0)
    await alert.catch_up()  # sees the head as stored
    await asyncio.to_thread(reset)
    await alert.catch_up()
    assert snapshot(connect, "sessions", "agent_id, session_key") == racing
    await store.apool.close()


def test_every_projection_is_inline_or_async_once() -> None:
    names = [p.name for p in (*INLINE, *ASYNC)]
    assert sorted(names) == sorted(set(names)) == ["approvals", "messages", "outbox", "schedules",
                                                   "session_context", "sessions",
                                                   "turns", "usage", "webhooks"]  # fmt: skip


def an_outbox_item(rng: random.Random, n: int) -> list[tuple[str, int, NewEvent]]:
    """``(stream, expected version, event)`` of one reply's chunks and their delivery lives."""
    from actors.outbox.plan import item_key
    from eventstore.catalogue import (
        Deliver,
        DeliveryAttempted,
        DeliveryEnqueued,
        DeliveryFailed,
        DeliveryRetry,
        DeliverySent,
        DeliveryUncertain,
    )

    turn_id = f"t_o{n}"
    meta = Metadata(agent_id="a", session_key=f"s{n % 3}", turn_id=turn_id)
    target = Deliver(channel="hooks", to=f"r{n % 2}")
    total = rng.randint(1, 3)
    keys = [item_key("a", meta.session_key or "", turn_id, target, i) for i in range(total)]
    out: list[tuple[str, int, NewEvent]] = [
        (f"turn-{turn_id}", -2, NewEvent(event=DeliveryEnqueued(
            channel_id="hooks", to=target.to, key=key, chunk_index=i, chunk_total=total,
            text=f"chunk {i}"), metadata=meta))
        for i, key in enumerate(keys)
    ]  # fmt: skip
    for i, key in enumerate(keys):
        stream, version, attempts = f"outbox-{key}", -1, 0
        while True:
            attempts += 1
            out.append((stream, version, NewEvent(event=DeliveryAttempted(
                channel_id="hooks", chunk_index=i, chunk_total=total, attempt=attempts),
                metadata=meta)))  # fmt: skip
            version += 1
            roll = rng.random()
            if roll < 0.2:
                out.append((stream, version, NewEvent(event=DeliveryRetry(
                    channel_id="hooks", chunk_index=i, attempts=attempts, delay_ms=1500,
                    error="busy", code="delivery_http_503"), metadata=meta)))  # fmt: skip
                version += 1
                continue
            if roll < 0.3:
                out.append((stream, version, NewEvent(event=DeliveryUncertain(
                    channel_id="hooks", chunk_index=i, chunk_total=total, attempts=attempts,
                    idempotent_send=True, resend=rng.random() < 0.5), metadata=meta)))  # fmt: skip
                return out
            if roll < 0.4:
                out.append((stream, version, NewEvent(event=DeliveryFailed(
                    channel_id="hooks", chunk_index=i, chunk_total=total, attempts=attempts,
                    exhausted=False, abandoned=total - i - 1, error="no", code="x"),
                    metadata=meta)))  # fmt: skip
                return out
            out.append((stream, version, NewEvent(event=DeliverySent(
                channel_id="hooks", chunk_index=i, chunk_total=total, attempts=attempts,
                provider_message_id=f"m{n}.{i}"), metadata=meta)))  # fmt: skip
            break
    return out


@pytest.mark.asyncio
async def test_the_outbox_and_schedules_rebuilt_equal_the_live_ones(
    store: EventStore, connect: ConnectFactory
) -> None:
    from eventstore.catalogue import ScheduleDefined, ScheduleFired, ScheduleRemoved
    from eventstore.projections.outbox import OutboxProjection
    from eventstore.projections.schedules import SchedulesProjection

    seed = int(os.environ.get("DISPACH_SEED") or random.randrange(2**32))
    print(f"DISPACH_SEED={seed}")
    rng = random.Random(seed)
    for n in range(40):
        for stream, expected, event in an_outbox_item(rng, n):
            await store.aappend(stream, [event], expected)
    meta = Metadata(agent_id="a")
    for n in range(6):
        stream = f"schedule-a-s{n}"
        spec = {"id": f"s{n}", "kind": "every", "expr": "1h", "task": "t", "deliver": "none"}
        events: list[Event] = [ScheduleDefined(schedule_id=f"s{n}", spec=spec, owner="api")]
        events += [ScheduleFired(schedule_id=f"s{n}", kind="every", drift_ms=3,
                                 due=f"2026-11-30T0{k}:00:00+00:00", turn_id=f"t_{k}")
                   for k in range(rng.randint(0, 3))]  # fmt: skip
        if rng.random() < 0.3:
            events.append(ScheduleRemoved(schedule_id=f"s{n}"))
        await store.aappend(stream, [NewEvent(event=e, metadata=meta) for e in events])
    live_outbox = snapshot(connect, "outbox", "item_id")
    live_schedules = snapshot(connect, "schedules", "agent_id, schedule_id")
    assert len(live_outbox) >= 40 and live_schedules
    with connect() as conn:
        held = conn.execute(b"SELECT status, chunk_index, body FROM outbox").fetchall()
    # A row holds its chunk's text while the item may still be sent, and none once it is settled.
    assert "sent" in {s for s, _, _ in held}, f"DISPACH_SEED={seed}"
    for status, index, body in held:
        sendable = status in ("pending", "inflight")
        assert body == (f"chunk {index}" if sendable else None), f"DISPACH_SEED={seed}"

    def rebuild_both() -> None:
        rebuild(store, OutboxProjection(), inline=True)
        rebuild(store, SchedulesProjection(), inline=True)

    await asyncio.to_thread(rebuild_both)
    assert snapshot(connect, "outbox", "item_id") == live_outbox, f"DISPACH_SEED={seed}"
    assert snapshot(connect, "schedules", "agent_id, schedule_id") == live_schedules
    await store.apool.close()
