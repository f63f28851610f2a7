"""Partition fencing: a node that lost a partition's lease cannot append for it (issue 14)."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterable

import psycopg
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from eventstore import (
    ANY,
    NO_STREAM,
    EventStore,
    Fence,
    Fenced,
    Metadata,
    NewEvent,
    RecordedEvent,
)
from eventstore.catalogue import ModelChunk
from eventstore.decision import Command, chain, continues
from eventstore.projector import Statement
from tests.conftest import LiveStore, Servers


def chunk(text: str, **ids: str) -> NewEvent:
    return NewEvent(event=ModelChunk(delta=text), metadata=Metadata(**ids))


def refusals() -> float:
    return REGISTRY.get_sample_value("dispach_fence_refusals_total") or 0.0


class Told:
    """What the store told ``on_fenced`` (called in the writer's thread)."""

    def __init__(self) -> None:
        self.partitions: list[int] = []
        self._lock = threading.Lock()

    def __call__(self, partition: int) -> None:
        with self._lock:
            self.partitions.append(partition)


@pytest_asyncio.fixture
async def sql(
    servers: Servers, schema: str
) -> AsyncIterator[psycopg.AsyncConnection[tuple[object, ...]]]:
    """A connection of the test's own (not the store's), for the locks a test holds."""
    conn = await psycopg.AsyncConnection.connect(
        servers.database_url, autocommit=True, options=f"-c search_path={schema}"
    )
    try:
        yield conn
    finally:
        await conn.close()


async def blocked_by(conn: psycopg.AsyncConnection[tuple[object, ...]], pid: int) -> int:
    """Wait (bounded) until a backend waits for a lock ``pid`` holds; returns that backend."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        cur = await conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))", [pid]
        )
        row = await cur.fetchone()
        if row is not None:
            return int(str(row[0]))
        await asyncio.sleep(0.01)
    raise AssertionError(f"nothing waited for backend {pid} within 10 s")


@pytest.mark.asyncio
async def test_an_append_under_the_current_epoch_commits(live: LiveStore) -> None:
    store = live.store
    assert await store.araise_fences([Fence(3, 5)]) == {3: 5}
    done = await store.aappend("turn-a", [chunk("a")], NO_STREAM, Fence(3, 5))
    assert done.version == 0
    # An epoch newer than the fence (its owner appends before its raise is seen) commits too.
    assert (await store.aappend("turn-a", [chunk("b")], 0, Fence(3, 6))).version == 1


@pytest.mark.asyncio
async def test_a_stale_owner_is_refused_and_nothing_of_it_is_stored(live: LiveStore) -> None:
    store = live.store
    told = Told()
    store.on_fenced = told  # the node sets it after construction
    await store.araise_fences([Fence(3, 5)])
    await store.aappend("session-s", [chunk("mine")], NO_STREAM, Fence(3, 5))
    before = refusals()
    assert await store.araise_fences([Fence(3, 6)]) == {3: 6}  # another node took partition 3

    with pytest.raises(Fenced) as caught:
        await store.aappend("session-s", [chunk("stale-1"), chunk("stale-2")], 0, Fence(3, 5))
    error = caught.value
    assert (error.code, error.stream, error.partition, error.epoch, error.current) == (
        "session_moving", "session-s", 3, 5, 6
    )  # fmt: skip
    assert "new owner" in error.hint
    assert [e.data for e in await store.aread_stream("session-s")] == [ModelChunk(delta="mine")]
    assert told.partitions == [3]  # told before the caller woke
    assert refusals() == before + 1
    # The new owner's append (same partition, new epoch) commits.
    assert (await store.aappend("session-s", [chunk("new")], 0, Fence(3, 6))).version == 1


@pytest.mark.asyncio
async def test_an_unfenced_append_is_unaffected(live: LiveStore) -> None:
    store = live.store
    await store.araise_fences([Fence(0, 100)])
    assert store.fencing is None
    assert (await store.aappend("turn-free", [chunk("a")], NO_STREAM)).version == 0


@pytest.mark.asyncio
async def test_the_hook_names_the_fence_when_the_caller_passes_none(live: LiveStore) -> None:
    store = live.store
    asked: list[tuple[str, Metadata]] = []

    def fencing(stream: str, metadata: Metadata) -> Fence | None:
        asked.append((stream, metadata))
        return Fence(7, 1) if metadata.session_key == "owned" else None

    store.fencing = fencing
    await store.araise_fences([Fence(7, 2)])
    first = chunk("a", agent_id="ag", session_key="owned")
    with pytest.raises(Fenced):
        await store.aappend("turn-h1", [first, chunk("b")], NO_STREAM)
    assert asked == [("turn-h1", first.metadata)]  # the stream and its first event's metadata
    # The hook finds no fence for this one; and a fence the caller passes is not asked about.
    assert (await store.aappend("turn-h2", [chunk("c", session_key="other")])).version == 0
    assert (await store.aappend("turn-h3", [chunk("d")], fence=Fence(7, 2))).version == 0
    assert [stream for stream, _ in asked] == ["turn-h1", "turn-h2"]


@pytest.mark.asyncio
async def test_an_append_waiting_on_a_raise_sees_the_new_epoch_and_its_neighbours_commit(
    live: LiveStore, sql: psycopg.AsyncConnection[tuple[object, ...]]
) -> None:
    store = live.store
    told = Told()
    store.on_fenced = told
    await store.araise_fences([Fence(1, 5), Fence(2, 4)])
    stored = [chunk("v")]
    first = await store.aappend("turn-v", stored, NO_STREAM, Fence(2, 4))
    # A raise of partition 1 in progress: its row is updated, not yet committed.
    await sql.execute("BEGIN")
    await sql.execute("UPDATE partition_fences SET epoch = 9 WHERE partition = 1")
    waiting = asyncio.wrap_future(store.submit("turn-w", [chunk("w")], NO_STREAM, Fence(1, 5)))
    await blocked_by(sql, sql.info.backend_pid)  # the writer waits for the raise
    # Queued behind it, so decided together in the next batch: one stale, two fine, and a
    # retry of stored events (its unique violation has the batch decided again, carefully).
    stale = asyncio.wrap_future(store.submit("turn-x", [chunk("x")], NO_STREAM, Fence(2, 3)))
    free = asyncio.wrap_future(store.submit("turn-y", [chunk("y")], NO_STREAM))
    current = asyncio.wrap_future(store.submit("turn-z", [chunk("z")], NO_STREAM, Fence(2, 4)))
    retry = asyncio.wrap_future(store.submit("turn-v", stored, NO_STREAM, Fence(2, 4)))
    assert not waiting.done()
    await sql.execute("COMMIT")

    with pytest.raises(Fenced) as caught:
        await asyncio.wait_for(waiting, 10)
    assert (caught.value.epoch, caught.value.current) == (5, 9)  # re-read once the raise committed
    with pytest.raises(Fenced):
        await asyncio.wait_for(stale, 10)
    assert (await asyncio.wait_for(free, 10)).version == 0
    assert (await asyncio.wait_for(current, 10)).version == 0
    again = await asyncio.wait_for(retry, 10)
    assert again.duplicate and again.events[0].position == first.events[0].position
    assert sorted(told.partitions) == [1, 2]
    assert await store.aread_stream("turn-w") == []
    assert await store.aread_stream("turn-x") == []


@pytest.mark.asyncio
async def test_a_failing_on_fenced_neither_changes_the_answer_nor_stops_the_writer(
    live: LiveStore,
) -> None:
    store = live.store

    def broken(partition: int) -> None:
        raise RuntimeError(f"bug while dropping partition {partition}")

    store.on_fenced = broken
    await store.araise_fences([Fence(5, 2)])
    with pytest.raises(Fenced):
        await store.aappend("turn-b", [chunk("a")], NO_STREAM, Fence(5, 1))
    assert (await store.aappend("turn-b", [chunk("b")], NO_STREAM, Fence(5, 2))).version == 0


@pytest.mark.asyncio
async def test_a_raise_is_monotonic(live: LiveStore) -> None:
    store = live.store
    assert await store.araise_fences([]) == {}
    assert await store.araise_fences([Fence(4, 10)]) == {4: 10}
    assert await store.araise_fences([Fence(4, 3), Fence(5, 1)]) == {4: 10, 5: 1}  # stale: kept
    assert await store.araise_fences([Fence(5, 2), Fence(5, 7), Fence(5, 6)]) == {5: 7}
    assert await store.afences() == {4: 10, 5: 7}


@pytest.mark.asyncio
async def test_a_raise_waits_for_a_transaction_holding_the_fence_for_share(
    live: LiveStore, sql: psycopg.AsyncConnection[tuple[object, ...]]
) -> None:
    store = live.store
    await store.araise_fences([Fence(6, 1)])
    await sql.execute("BEGIN")
    await sql.execute("SELECT epoch FROM partition_fences WHERE partition = 6 FOR SHARE")
    finished = asyncio.Event()

    async def raise_() -> dict[int, int]:
        try:
            return await store.araise_fences([Fence(6, 2)])
        finally:
            finished.set()

    task = asyncio.create_task(raise_())
    await blocked_by(sql, sql.info.backend_pid)  # the raise waits for our lock
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(finished.wait()), 0.2)
    assert not task.done()
    await sql.execute("COMMIT")
    assert await asyncio.wait_for(task, 10) == {6: 2}
    assert await store.afences() == {6: 2}


class _Gate:
    """An inline projection whose statement waits for an advisory lock the test holds: it keeps
    the writer's transaction open after the insert, as a slow commit would."""

    name = "gate"
    tables: tuple[str, ...] = ()
    types = frozenset({ModelChunk.TYPE})

    def __init__(self, key: int) -> None:
        self.key = key

    def statements(self, event: RecordedEvent) -> Iterable[Statement]:
        if isinstance(event.data, ModelChunk) and event.data.delta == "gated":
            return [("SELECT pg_advisory_xact_lock_shared(%s)", [self.key])]
        return []


@pytest.mark.asyncio
async def test_a_raise_waits_for_an_append_in_flight_under_the_old_epoch(
    servers: Servers, schema: str, sql: psycopg.AsyncConnection[tuple[object, ...]]
) -> None:
    key = secrets.randbits(62)
    store = EventStore(servers.database_url, schema=schema, inline=[_Gate(key)])
    await store.aopen()
    try:
        await store.araise_fences([Fence(8, 5)])
        await sql.execute("SELECT pg_advisory_lock(%s)", [key])
        append = asyncio.wrap_future(
            store.submit("turn-g", [chunk("gated")], NO_STREAM, Fence(8, 5))
        )
        writer = await blocked_by(sql, sql.info.backend_pid)  # inserted, not committed
        raising = asyncio.create_task(store.araise_fences([Fence(8, 6)]))
        await blocked_by(sql, writer)  # the raise waits for the append's FOR SHARE lock
        assert not raising.done() and not append.done()
        await sql.execute("SELECT pg_advisory_unlock(%s)", [key])
        assert await asyncio.wait_for(raising, 10) == {8: 6}
        # The raise returned after the append committed: the event is there, and it is the last
        # append under epoch 5 that commits.
        assert [e.data for e in await store.aread_stream("turn-g")] == [ModelChunk(delta="gated")]
        assert (await asyncio.wait_for(append, 10)).version == 0
        with pytest.raises(Fenced):
            await store.aappend("turn-g", [chunk("late")], ANY, Fence(8, 5))
    finally:
        await store.aclose()


@pytest.mark.asyncio
async def test_a_retry_of_stored_events_under_a_now_stale_epoch_is_answered_as_a_duplicate(
    live: LiveStore,
) -> None:
    # The events were committed while the epoch was current: the retry writes nothing, so
    # answering the original positions lets the caller finish without a false failure.
    store = live.store
    told = Told()
    store.on_fenced = told
    await store.araise_fences([Fence(9, 1)])
    events = [chunk("a"), chunk("b")]
    original = await store.aappend("turn-r", events, NO_STREAM, Fence(9, 1))
    await store.araise_fences([Fence(9, 2)])
    again = await store.aappend("turn-r", events, NO_STREAM, Fence(9, 1))
    assert again.duplicate
    assert [(e.position, e.version) for e in again.events] == [
        (e.position, e.version) for e in original.events
    ]
    assert told.partitions == []  # nothing was refused
    # A new event under the stale epoch is refused.
    with pytest.raises(Fenced):
        await store.aappend("turn-r", [chunk("c")], 1, Fence(9, 1))


def test_only_appends_under_equal_fences_chain() -> None:
    first = Command("turn-c", [chunk("a")], NO_STREAM, fence=Fence(1, 1))
    assert continues(first, Command("turn-c", [chunk("b")], 0, fence=Fence(1, 1)))
    assert not continues(first, Command("turn-c", [chunk("b")], 0, fence=Fence(1, 2)))
    assert not continues(first, Command("turn-c", [chunk("b")], 0))
    merged = chain(first, Command("turn-c", [chunk("b")], 0, fence=Fence(1, 1)))
    assert merged.fence == Fence(1, 1)
    with pytest.raises(ValueError, match="different fences"):
        chain(first, Command("turn-c", [chunk("b")], 0))
