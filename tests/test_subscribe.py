"""Live subscriptions: catch-up then tail, woken by NATS commit hints, resumable."""

from __future__ import annotations

import asyncio
import os
import random
import threading
import uuid

import pytest

from eventstore import START, Checkpoint, EventStore, Metadata, NewEvent, RecordedEvent
from eventstore.catalogue import ModelChunk
from tests.conftest import LiveStore, Servers
from tests.storeops import append


def chunks(n: int) -> list[NewEvent]:
    return [NewEvent(event=ModelChunk(delta=str(i))) for i in range(n)]


@pytest.mark.asyncio
async def test_catch_up_then_live_in_one_loop(live: LiveStore) -> None:
    store = live.store
    before = await store.aappend("turn-a", chunks(5))
    got: list[RecordedEvent] = []

    async def consume() -> None:
        async for event in store.subscribe(START):
            got.append(event)
            if len(got) == 8:
                return

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    after = await store.aappend("turn-b", chunks(3))
    # The store polls only every 30 s here: finishing promptly proves the NATS hint woke it.
    await asyncio.wait_for(task, 5)
    assert [e.event_id for e in got] == [e.event_id for e in before.events + after.events]


@pytest.mark.asyncio
async def test_hints_are_published_per_agent_session_and_turn(live: LiveStore) -> None:
    received: list[str] = []
    done = asyncio.Event()

    async def on_msg(msg: object) -> None:
        received.append(msg.subject)  # type: ignore[attr-defined]
        done.set()

    sub = await live.nc.subscribe("dispach.events.ag.>", cb=on_msg)
    meta = Metadata(agent_id="ag", session_key="tg:-100123 secret words", turn_id="t_1")
    await live.store.aappend("turn-t_1", [NewEvent(event=ModelChunk(delta="x"), metadata=meta)])
    await asyncio.wait_for(done.wait(), 5)
    await sub.unsubscribe()
    [subject] = received
    assert subject.startswith("dispach.events.ag.") and subject.endswith(".t_1")
    assert "secret" not in subject and "-100123" not in subject  # no raw user text in subjects


@pytest.mark.asyncio
async def test_a_subscriber_killed_and_restarted_from_its_checkpoint_misses_and_repeats_nothing(
    live: LiveStore, servers: Servers, schema: str
) -> None:
    seed = int(os.environ.get("DISPACH_SEED") or random.randrange(2**32))
    print(f"DISPACH_SEED={seed}")
    rng = random.Random(seed)
    store = live.store
    # A second node's writer on the same log, so appends really interleave across transactions.
    other = EventStore(servers.database_url, schema=schema)
    other.open()
    written: list[uuid.UUID] = []
    lock = threading.Lock()

    def write(s: EventStore, prefix: str) -> None:
        for i in range(150):
            result = append(s, f"turn-{prefix}{i % 7}", chunks(rng.randint(1, 3)))
            with lock:
                written.extend(e.event_id for e in result.events)

    writers = [
        threading.Thread(target=write, args=(store, "x")),
        threading.Thread(target=write, args=(other, "y")),
    ]
    for w in writers:
        w.start()

    processed: list[uuid.UUID] = []
    saved = START  # the subscriber's durable checkpoint, stored after each event it processes

    async def subscriber(stop_after: int | None) -> None:
        nonlocal saved
        async for event in store.subscribe(saved, batch=rng.randint(3, 40)):
            processed.append(event.event_id)
            saved = event.checkpoint
            if stop_after is not None and len(processed) >= stop_after:
                await asyncio.sleep(3600)  # killed here, between two events

    for kill_at in sorted(rng.sample(range(1, 500), 4)):
        task = asyncio.create_task(subscriber(kill_at))
        while len(processed) < kill_at and not task.done():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    for w in writers:
        await asyncio.to_thread(w.join)
    other.close()
    task = asyncio.create_task(subscriber(None))
    for _ in range(1000):
        if len(processed) >= len(written):
            break
        await asyncio.sleep(0.01)
    task.cancel()
    context = f"(DISPACH_SEED={seed})"
    assert len(processed) == len(set(processed)), f"an event was processed twice {context}"
    assert set(processed) == set(written), context


@pytest.mark.asyncio
async def test_without_hints_a_subscriber_still_gets_events_by_polling(
    servers: Servers, schema: str
) -> None:
    store = EventStore(servers.database_url, schema=schema, poll_interval=0.02)
    await store.aopen()
    try:
        got: list[Checkpoint] = []

        async def consume() -> None:
            async for event in store.subscribe(START):
                got.append(event.checkpoint)
                return

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        result = await store.aappend("turn-p", chunks(1))
        await asyncio.wait_for(task, 5)
        assert got == [result.checkpoint]
    finally:
        await store.aclose()


@pytest.mark.asyncio
async def test_filters_skip_without_stalling_the_checkpoint(live: LiveStore) -> None:
    store = live.store
    await store.aappend("outbox-1", chunks(50))
    wanted = await store.aappend("turn-z", chunks(2))
    got: list[RecordedEvent] = []
    async for event in store.subscribe(START, where=lambda e: e.category == "turn", batch=10):
        got.append(event)
        if len(got) == 2:
            break
    assert [e.event_id for e in got] == [e.event_id for e in wanted.events]


@pytest.mark.asyncio
async def test_a_tail_narrowed_to_types_sees_each_of_them_once(live: LiveStore) -> None:
    from eventstore.catalogue import SessionCleared

    store = live.store

    def mixed(n: int) -> list[NewEvent]:
        return [NewEvent(event=SessionCleared(by=str(i)) if i % 3 == 0 else ModelChunk(delta="x"))
                for i in range(n)]  # fmt: skip

    first = await store.aappend("session-a-1", mixed(6))
    got: list[RecordedEvent] = []

    async def consume() -> None:
        async for event in store.subscribe(START, types=("session.cleared",), batch=2):
            got.append(event)
            if len(got) == 4:
                return

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    second = await store.aappend("session-a-2", mixed(6))
    await asyncio.wait_for(task, 5)
    wanted = [e.event_id for e in first.events + second.events if e.type == "session.cleared"]
    assert [e.event_id for e in got] == wanted
