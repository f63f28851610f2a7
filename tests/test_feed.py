"""The node's one tail of the log (eventstore/feed.py): subscriptions catch up from Postgres, go
live without a gap or a repeat, survive a reader slower than their buffer, and see only their
scope."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
import pytest_asyncio

from eventstore import START, Checkpoint, EventStore, Metadata, NewEvent, RecordedEvent
from eventstore.catalogue import ModelChunk, TurnStopping
from eventstore.feed import Feed, Scope, Subscription
from tests.conftest import ConnectFactory, LiveStore, Servers

Wanted = Callable[[RecordedEvent], bool]


def event(
    n: int, turn: str, agent: str = "ag", session: str = "s", kind: str = "model.chunk"
) -> NewEvent:
    meta = Metadata(agent_id=agent, session_key=session, turn_id=turn)
    data = ModelChunk(delta=str(n)) if kind == "model.chunk" else TurnStopping(by=str(n))
    return NewEvent(event=data, metadata=meta)


def batch(size: int, turn: str, agent: str = "ag", session: str = "s") -> list[NewEvent]:
    return [event(i, turn, agent, session) for i in range(size)]


def ids(events: Sequence[RecordedEvent]) -> list[uuid.UUID]:
    return [e.event_id for e in events]


async def log_after(store: EventStore, after: Checkpoint = START) -> list[RecordedEvent]:
    """The whole log after ``after``, in checkpoint order (what every subscriber is checked
    against)."""
    out: list[RecordedEvent] = []
    while page := await store.aread_all(after, 1000):
        out.extend(page)
        after = page[-1].checkpoint
    return out


async def take(sub: Subscription, count: int, timeout: float = 20.0) -> list[RecordedEvent]:
    """Read until ``count`` events arrived, then make sure no more come."""
    got: list[RecordedEvent] = []
    async with asyncio.timeout(timeout):
        while len(got) < count:
            got.extend(await sub.read(1.0))
    got.extend(await sub.read(0.3))
    return got


@contextlib.asynccontextmanager
async def running(store: EventStore) -> AsyncIterator[Feed]:
    feed = Feed(store)
    task = asyncio.create_task(feed.run(), name="feed")
    await feed.ready()
    try:
        yield feed
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest_asyncio.fixture
async def feed(live: LiveStore) -> AsyncIterator[Feed]:
    async with running(live.store) as feed:
        yield feed


async def caught_up(feed: Feed, checkpoint: Checkpoint, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while feed.position < checkpoint:
            await asyncio.sleep(0.005)


@pytest.mark.asyncio
async def test_a_subscription_from_a_past_checkpoint_catches_up_then_goes_live_while_writers_append(
    live: LiveStore, feed: Feed, servers: Servers, schema: str
) -> None:
    store = live.store
    for i in range(60):  # more than one catch-up page (500 events)
        await store.aappend(f"turn-p{i % 3}", batch(10, f"p{i % 3}"))
    after = (await log_after(store))[49].checkpoint
    # A second writer on the same log, so transactions really interleave (it publishes no hints:
    # the last append below goes through the hinted store and wakes the feed for both).
    other = EventStore(servers.database_url, schema=schema)
    await other.aopen()

    async def write(s: EventStore, prefix: str) -> None:
        for i in range(60):
            await s.aappend(f"turn-{prefix}{i % 4}", batch(1 + i % 3, f"{prefix}{i % 4}"))
            await asyncio.sleep(0.001)

    writers = [
        asyncio.create_task(write(store, "x")),
        asyncio.create_task(write(store, "y")),
        asyncio.create_task(write(other, "z")),
    ]
    try:
        await asyncio.sleep(0.01)
        async with feed.subscribe(Scope(), after) as sub:
            got: list[RecordedEvent] = []
            while not all(w.done() for w in writers):
                got.extend(await sub.read(0.05))
            await asyncio.gather(*writers)
            await store.aappend("turn-end", batch(1, "end"))
            expected = await log_after(store, after)
            got.extend(await take(sub, len(expected) - len(got)))
    finally:
        await other.aclose()
    assert sub.catching_up is False
    assert ids(got) == ids(expected)


@pytest.mark.asyncio
async def test_a_live_subscription_sees_only_events_after_it_subscribed(
    live: LiveStore, feed: Feed
) -> None:
    store = live.store
    await store.aappend("turn-old", batch(20, "old"))
    async with feed.subscribe(Scope()) as sub:
        after = await store.aappend("turn-new", batch(10, "new"))
        got = await take(sub, 10)
    assert ids(got) == ids(after.events)


@pytest.mark.asyncio
async def test_a_live_subscription_gets_no_event_committed_before_it_subscribed(
    servers: Servers, schema: str
) -> None:
    # A store without NATS hints that polls every 30 s: the tail sees a commit only when the test
    # wakes it, so "committed, but not yet tailed" (a hint still in flight) is reproduced exactly.
    store = EventStore(servers.database_url, schema=schema, poll_interval=30.0)
    await store.aopen()
    try:
        async with (
            running(store) as feed,
            feed.subscribe(Scope(turn_id="elsewhere")),  # keeps the tail running
        ):
            earlier = await store.aappend("turn-old", batch(5, "old"))
            async with feed.subscribe(Scope()) as sub:
                later = await store.aappend("turn-new", batch(3, "new"))
                store.hints.notify(later.checkpoint)
                await caught_up(feed, later.checkpoint)
                got = await take(sub, 3)
    finally:
        await store.aclose()
    leaked = [e.stream for e in got if e.event_id in set(ids(earlier.events))]
    assert leaked == [], "events committed before the live subscription began reached it"
    assert ids(got) == ids(later.events)


@pytest.mark.asyncio
async def test_a_reader_slower_than_its_buffer_still_gets_every_event_once_in_order(
    live: LiveStore, feed: Feed
) -> None:
    store = live.store
    start = await store.aappend("turn-start", batch(1, "start"))

    async def write(prefix: str) -> None:
        for i in range(100):
            await store.aappend(f"turn-{prefix}{i % 5}", batch(1 + i % 3, f"{prefix}{i % 5}"))

    async with feed.subscribe(Scope(), buffer=4) as sub:
        writers = [asyncio.create_task(write(p)) for p in "abc"]
        got: list[RecordedEvent] = []
        while not all(w.done() for w in writers):
            got.extend(await sub.read(0.05))
            await asyncio.sleep(0.02)  # the slow reader
        await asyncio.gather(*writers)
        expected = await log_after(store, start.checkpoint)
        got.extend(await take(sub, len(expected) - len(got)))
    assert len(expected) == 3 * 199
    assert sub.overflows > 0
    assert len(got) == len(set(ids(got))), "an event was delivered twice"
    assert ids(got) == ids(expected)


NOISE = """INSERT INTO events (stream_id, stream_version, event_id, type, data, metadata)
           SELECT 'noise-' || (g / 1000), g %% 1000, gen_random_uuid(), 'model.chunk',
                  '{"delta": "n"}', '{"agentId": "other"}'
             FROM generate_series(0, %s - 1) AS g"""


@pytest.mark.asyncio
async def test_a_reader_that_overflows_while_it_catches_up_loses_nothing(
    live: LiveStore, feed: Feed, connect: ConnectFactory
) -> None:
    # 80,000 events of another agent first: the catch-up query of agent "a" (not indexed by
    # agent) scans them for tens of milliseconds, while the tail, reading from the head, hands
    # the subscription new events of "a". With a buffer of 1 every 3-event commit overflows it,
    # so overflows land in the middle of that catch-up read.
    def noise() -> None:
        with connect() as conn:
            conn.execute(NOISE, [80_000])

    await asyncio.to_thread(noise)
    store = live.store
    stop = asyncio.Event()
    expected: list[RecordedEvent] = []  # one sequential writer: its commits are in log order

    async def write() -> None:
        i = 0
        while not stop.is_set():
            result = await store.aappend(f"turn-a{i % 5}", batch(3, f"a{i % 5}", agent="a"))
            expected.extend(result.events)
            i += 1

    got: dict[int, list[RecordedEvent]] = {}
    overflows: dict[int, int] = {}

    async def reader(n: int) -> None:
        async with feed.subscribe(Scope(agent_id="a"), START, buffer=1) as sub:
            got[n] = []
            try:
                while True:
                    got[n].extend(await sub.read(1.0))
            finally:
                overflows[n] = sub.overflows

    writer = asyncio.create_task(write())
    readers: list[asyncio.Task[None]] = []
    try:
        for n in range(8):  # each starts with its own slow catch-up, at a different moment
            await asyncio.sleep(0.03)
            readers.append(asyncio.create_task(reader(n)))
        await asyncio.sleep(0.1)
        stop.set()
        await writer
        async with asyncio.timeout(10):
            while any(len(g) < len(expected) for g in got.values()):
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # room for a late duplicate
    except TimeoutError:
        pass  # the comparison below says what is missing
    finally:
        stop.set()
        for task in readers:
            task.cancel()
        await asyncio.gather(writer, *readers, return_exceptions=True)
    assert all(o > 0 for o in overflows.values())
    short = {n: len(expected) - len(g) for n, g in got.items() if ids(g) != ids(expected)}
    assert short == {}, f"readers lost events (reader: how many) of {len(expected)}"


def written() -> list[NewEvent]:
    """Events for every scope: two agents, two sessions, three turns, two types."""
    out: list[NewEvent] = []
    n = 0
    for agent, session, turn in [("a", "s1", "t1"), ("a", "s2", "t2"), ("b", "s1", "t3")]:
        for kind in ["model.chunk", "turn.stopping", "model.chunk"]:
            out.append(event(n, turn, agent, session, kind))
            n += 1
    return out


SCOPES: list[tuple[str, Scope, Callable[[Metadata, str], bool]]] = [
    ("one turn", Scope(turn_id="t1"), lambda m, t: m.turn_id == "t1"),
    (
        "one turn, no chunks",
        Scope(turn_id="t2", chunks=False),
        lambda m, t: m.turn_id == "t2" and t != "model.chunk",
    ),
    ("an agent", Scope(agent_id="a"), lambda m, t: m.agent_id == "a"),
    (
        "an agent's session",
        Scope(agent_id="a", session_key="s1"),
        lambda m, t: m.agent_id == "a" and m.session_key == "s1",
    ),
    (
        "a session key alone",
        Scope(session_key="s1"),
        lambda m, t: m.session_key == "s1",
    ),
    (
        "some types",
        Scope(types=frozenset({"turn.stopping"})),
        lambda m, t: t == "turn.stopping",
    ),
    ("no chunks", Scope(chunks=False), lambda m, t: t != "model.chunk"),
    ("a scoped token", Scope(agents=frozenset({"b"})), lambda m, t: m.agent_id == "b"),
    (
        "a scoped token asking for another agent",
        Scope(agent_id="a", agents=frozenset({"b"})),
        lambda m, t: False,
    ),
]


@pytest.mark.parametrize("mode", ["catch-up", "live"])
@pytest.mark.parametrize(("scope", "wanted"), [s[1:] for s in SCOPES], ids=[s[0] for s in SCOPES])
@pytest.mark.asyncio
async def test_a_subscription_sees_only_its_scope(
    live: LiveStore, feed: Feed, scope: Scope, wanted: Callable[[Metadata, str], bool], mode: str
) -> None:
    store = live.store
    events = written()
    marker = await store.aappend("turn-marker", batch(1, "marker", agent="z"))

    async def write() -> list[RecordedEvent]:
        out: list[RecordedEvent] = []
        for new in events:
            meta = new.metadata
            out.extend((await store.aappend(f"turn-{meta.turn_id}", [new])).events)
        return out

    if mode == "catch-up":
        stored = await write()
        async with feed.subscribe(scope, marker.checkpoint) as sub:
            expected = [e for e in stored if wanted(e.metadata, e.type)]
            got = await take(sub, len(expected), timeout=5)
    else:
        async with feed.subscribe(scope) as sub:
            stored = await write()
            expected = [e for e in stored if wanted(e.metadata, e.type)]
            got = await take(sub, len(expected), timeout=5)
    assert [(e.metadata.turn_id, e.type) for e in got] == [
        (e.metadata.turn_id, e.type) for e in expected
    ]
    assert ids(got) == ids(expected)


@pytest.mark.asyncio
async def test_closing_a_subscription_removes_it_from_the_feed(feed: Feed) -> None:
    assert feed.subscribers == 0
    async with (
        feed.subscribe(Scope(turn_id="t1")) as one,
        feed.subscribe(Scope(turn_id="t1")) as two,
        feed.subscribe(Scope(agent_id="a")),
    ):
        assert feed.subscribers == 3
        one.close()
        assert one.closed and feed.subscribers == 2
        one.close()  # closing twice is harmless
        assert feed.subscribers == 2
    assert two.closed
    assert feed.subscribers == 0

    started = asyncio.Event()

    async def reader() -> None:
        async with feed.subscribe(Scope(turn_id="t2")) as sub:
            started.set()
            await sub.read(60)

    task = asyncio.create_task(reader())
    await started.wait()
    assert feed.subscribers == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert feed.subscribers == 0


@pytest.mark.asyncio
async def test_random_writers_and_subscribers_miss_and_repeat_nothing(
    live: LiveStore, feed: Feed, servers: Servers, schema: str
) -> None:
    seed = int(os.environ.get("DISPACH_SEED") or random.randrange(2**32))
    print(f"DISPACH_SEED={seed}")
    rng = random.Random(seed)
    context = f"(DISPACH_SEED={seed})"
    store = live.store
    other = EventStore(servers.database_url, schema=schema)  # unhinted: interleaves transactions
    await other.aopen()
    agents, sessions, turns = ["a", "b"], ["s1", "s2"], [f"t{i}" for i in range(6)]
    checkpoints: list[Checkpoint] = []

    async def write(s: EventStore, wrng: random.Random) -> None:
        for _ in range(wrng.randint(60, 120)):
            turn = wrng.choice(turns)
            agent = agents[int(turn[1:]) % 2]
            session = sessions[int(turn[1:]) // 2 % 2]
            kind = wrng.choice(["model.chunk", "model.chunk", "turn.stopping"])
            new = [event(i, turn, agent, session, kind) for i in range(wrng.randint(1, 4))]
            result = await s.aappend(f"turn-{turn}", new)
            checkpoints.append(result.checkpoint)
            if wrng.random() < 0.3:
                await asyncio.sleep(wrng.random() * 0.01)

    class Reader:
        def __init__(self, n: int, rrng: random.Random) -> None:
            self.scope = rrng.choice(
                [
                    Scope(),
                    Scope(agent_id=rrng.choice(agents)),
                    Scope(agent_id="a", session_key=rrng.choice(sessions)),
                    Scope(turn_id=rrng.choice(turns)),
                    Scope(chunks=False),
                    Scope(types=frozenset({"turn.stopping"})),
                ]
            )
            self.buffer = rrng.choice([2, 4, 16, 1024])
            self.delay = rrng.choice([0.0, 0.0, 0.002, 0.01])
            self.wait = rrng.random() * 0.2
            self.from_past = rrng.random() < 0.7
            self.rng = rrng
            self.name = f"reader {n}: {self.scope}, buffer {self.buffer}, delay {self.delay}"
            self.start: Checkpoint | None = None
            self.got: list[RecordedEvent] = []
            self.overflows = 0

        async def run(self) -> None:
            await asyncio.sleep(self.wait)
            after = self.rng.choice([START, *checkpoints]) if self.from_past else None
            async with feed.subscribe(self.scope, after, buffer=self.buffer) as sub:
                self.start = sub.last
                try:
                    while True:
                        self.got.extend(await sub.read(1.0))
                        if self.delay:
                            await asyncio.sleep(self.delay)
                finally:
                    self.overflows = sub.overflows

    readers = [Reader(n, random.Random(rng.random())) for n in range(6)]
    reading = [asyncio.create_task(r.run()) for r in readers]
    try:
        await asyncio.gather(
            write(store, random.Random(rng.random())),
            write(store, random.Random(rng.random())),
            write(other, random.Random(rng.random())),
        )
        await store.aappend("turn-last", [event(0, "last", "a", "s1")])  # wakes the feed
        log = await log_after(store)
        expected: dict[str, list[uuid.UUID]] = {}
        for r in readers:
            assert r.start is not None
            expected[r.name] = ids(
                [e for e in log if e.checkpoint > r.start and r.scope.matches(e)]
            )
        async with asyncio.timeout(30):
            while any(len(r.got) < len(expected[r.name]) for r in readers):
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # room for a duplicate to show up
    finally:
        for task in reading:
            task.cancel()
        await asyncio.gather(*reading, return_exceptions=True)
        await other.aclose()
    assert feed.subscribers == 0
    for r in readers:
        got = ids(r.got)
        assert len(got) == len(set(got)), f"{r.name} got an event twice {context}"
        assert got == expected[r.name], f"{r.name} (overflows: {r.overflows}) {context}"
