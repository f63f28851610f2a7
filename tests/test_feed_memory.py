"""A turn's events held in memory as this node commits them (eventstore/feed.py, Feed.remember):
a reader of that turn starts from memory and its catch-up from Postgres goes on after it, with
no event lost or repeated; memory serves a turn only while it holds it whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import psycopg
import pytest
import pytest_asyncio

from eventstore import NO_STREAM, START, AppendResult, Metadata, NewEvent, RecordedEvent
from eventstore.catalogue import TurnStart
from eventstore.feed import _RECENT_BYTES, _RECENT_EVENTS, _SILENCE, Feed, Scope
from tests.conftest import LiveStore, Servers
from tests.test_feed import batch, caught_up, ids, running, take


@pytest_asyncio.fixture
async def feed(live: LiveStore) -> AsyncIterator[Feed]:
    async with running(live.store) as feed:
        yield feed


async def append(live: LiveStore, turn: str, size: int, expected: int) -> AppendResult:
    return await live.store.aappend(f"turn-{turn}", batch(size, turn), expected)


@pytest.mark.asyncio
async def test_a_reader_starts_from_memory_and_catches_up_from_postgres_after_it(
    live: LiveStore, feed: Feed
) -> None:
    first = await append(live, "m", 3, NO_STREAM)
    second = await append(live, "m", 2, 2)
    feed.remember(first.events)
    feed.remember(second.events)
    # Committed, but not handed to memory yet (the writer's hand-over can come after the tail
    # has read it): the catch-up must still deliver it.
    late = await append(live, "m", 4, 4)

    held = feed.recent("m", START)
    assert held is not None and ids(held) == ids([*first.events, *second.events])
    assert feed.recent("m", first.events[-1].checkpoint) == second.events

    async with feed.subscribe(Scope(turn_id="m"), START) as sub:
        shown = sub.start_after(feed.recent("m", START) or [])
        rest = await take(sub, len(late.events))
        live_one = await append(live, "m", 1, 8)
        rest.extend(await take(sub, 1))
    got: list[RecordedEvent] = [*shown, *rest]
    assert ids(got) == ids([*first.events, *second.events, *late.events, *live_one.events])


@pytest.mark.asyncio
async def test_memory_serves_only_a_turn_it_holds_from_its_first_event_without_a_gap(
    live: LiveStore, feed: Feed
) -> None:
    begun = await append(live, "a", 2, NO_STREAM)
    later = await append(live, "a", 2, 1)
    feed.remember(later.events)  # begun elsewhere (a resumed turn): not from version 0
    assert feed.recent("a", START) is None

    start = await append(live, "g", 1, NO_STREAM)
    skipped = await append(live, "g", 1, 0)
    after = await append(live, "g", 1, 1)
    feed.remember(start.events)
    assert feed.recent("g", START) == start.events
    feed.remember(after.events)  # version 2 after 0: another node wrote version 1
    assert feed.recent("g", START) is None
    assert skipped.events and begun.events

    other = await append(live, "w", 1, NO_STREAM)
    feed.remember(other.events)
    assert feed.recent("w", START) == other.events
    feed.remember([])
    assert feed.recent("nobody", START) is None


@pytest.mark.asyncio
async def test_memory_is_bounded_and_lets_the_oldest_turns_go_first(
    live: LiveStore, feed: Feed
) -> None:
    size = 512
    turns = _RECENT_EVENTS // size + 2
    for n in range(turns):
        feed.remember((await append(live, f"b{n}", size, NO_STREAM)).events)
    held = [n for n in range(turns) if feed.recent(f"b{n}", START) is not None]
    assert held == list(range(turns - _RECENT_EVENTS // size, turns))
    assert sum(len(feed.recent(f"b{n}", START) or []) for n in held) <= _RECENT_EVENTS


@pytest.mark.asyncio
async def test_a_reader_from_memory_also_gets_the_turns_events_on_other_streams(
    live: LiveStore, feed: Feed
) -> None:
    """A turn's scope is every event with its id, whatever the stream (a note the turn's tool
    writes on the session's stream): a reader served from memory gets those between the held
    events too, in the log's order."""
    first = await append(live, "o", 2, NO_STREAM)
    note = await live.store.aappend("session-ag-s", batch(1, "o"), NO_STREAM)
    second = await append(live, "o", 2, 1)
    for committed in (first, note, second):
        feed.remember(committed.events)
    expected = [*first.events, *note.events, *second.events]

    async with feed.subscribe(Scope(turn_id="o"), START) as sub:
        shown = sub.start_after(feed.recent("o", START) or [])
        rest = await take(sub, max(0, len(expected) - len(shown)))
    assert ids([*shown, *rest]) == ids(expected)


@pytest.mark.asyncio
async def test_a_held_turns_new_events_reach_its_readers_from_memory_before_the_tail(
    live: LiveStore, feed: Feed, servers: Servers, schema: str
) -> None:
    """This node's commits of a held turn go to the turn's readers as they are handed over,
    without waiting for the tail's read: here an append left open holds every reader of the
    log back, and the turn's new events still arrive, once each, in order."""
    first = await append(live, "h", 1, NO_STREAM)
    feed.remember(first.events)
    async with feed.subscribe(Scope(turn_id="h"), START) as sub:
        shown = sub.start_after(feed.recent("h", START) or [])
        assert ids(shown) == ids(first.events)
        assert await sub.read(0.05) == []  # the catch-up from Postgres, done
        assert not sub.catching_up
        stray = await psycopg.AsyncConnection.connect(servers.database_url)
        try:
            await stray.execute(f'SET search_path TO "{schema}"')
            await stray.execute(
                "INSERT INTO events (stream_id, stream_version, event_id, type, data)"
                " VALUES ('raw-open', 0, gen_random_uuid(), 'model.chunk', '{}')"
            )
            second = await append(live, "h", 2, 0)
            assert await live.store.aread_all(first.events[-1].checkpoint, 10) == []  # held back
            feed.remember(second.events)
            assert ids(await take(sub, 2, timeout=5)) == ids(second.events)
        finally:
            await stray.rollback()
            await stray.close()
        # The tail reads them too once the open append is gone: they are not given twice.
        third = await append(live, "h", 1, 2)
        feed.remember(third.events)
        assert ids(await take(sub, 1)) == ids(third.events)


@pytest.mark.asyncio
async def test_a_reader_of_memory_catches_up_once_the_tail_shows_events_memory_lacks(
    live: LiveStore, feed: Feed
) -> None:
    """Another node goes on with a turn this node held (appended here without the hand-over
    to memory, as another node's would be): its events are in Postgres and the tail reads
    them, memory never gives them, and the reader gets all of them, in order, once each, the
    ones the tail had read before the reader came included."""
    mine = await append(live, "x", 2, NO_STREAM)
    feed.remember(mine.events)
    async with feed.subscribe(Scope(), None) as witness:  # keeps the tail reading meanwhile
        earlier = await append(live, "x", 1, 1)  # another node's, before the reader
        await caught_up(feed, earlier.events[-1].checkpoint)
        async with feed.subscribe(Scope(turn_id="x"), START) as sub:
            shown = sub.start_after(feed.recent("x", START) or [])
            assert ids(shown) == ids(mine.events) and not sub.catching_up
            started = asyncio.get_running_loop().time()
            later = await append(live, "x", 2, 2)  # and after: the tail shows it
            rest = await take(sub, 3, timeout=5)
            assert asyncio.get_running_loop().time() - started < _SILENCE  # not the silence
        assert witness.overflows == 0
    assert ids(rest) == ids([*earlier.events, *later.events])


@pytest.mark.asyncio
async def test_a_reader_of_memory_looks_in_postgres_after_a_silence_or_when_memory_lets_go(
    live: LiveStore, feed: Feed
) -> None:
    """Memory holds a turn another node already went on with, and nothing more comes: after
    ``_SILENCE`` the reader looks in Postgres and finds it. A turn memory lets go of (newer
    turns pushed it out) is read from Postgres at once."""
    mine = await append(live, "q", 1, NO_STREAM)
    feed.remember(mine.events)
    elsewhere = await append(live, "q", 2, 0)
    async with feed.subscribe(Scope(turn_id="q"), START) as sub:
        assert ids(sub.start_after(feed.recent("q", START) or [])) == ids(mine.events)
        started = asyncio.get_running_loop().time()
        assert ids(await take(sub, 2, timeout=5)) == ids(elsewhere.events)
        assert asyncio.get_running_loop().time() - started >= _SILENCE

    gone = await append(live, "g2", 1, NO_STREAM)
    feed.remember(gone.events)
    async with feed.subscribe(Scope(turn_id="g2"), START) as sub:
        sub.start_after(feed.recent("g2", START) or [])
        more = await append(live, "g2", 1, 0)  # committed; memory is not told
        for n in range(_RECENT_EVENTS // 512 + 1):  # newer turns push "g2" out
            feed.remember((await append(live, f"push{n}", 512, NO_STREAM)).events)
        assert feed.recent("g2", START) is None and sub.catching_up
        started = asyncio.get_running_loop().time()
        assert ids(await take(sub, 1, timeout=5)) == ids(more.events)
        assert asyncio.get_running_loop().time() - started < _SILENCE


def tails(feed: Feed) -> bool:
    return feed.tails_own_commits  # a call: mypy narrows an attribute across the asserts


@pytest.mark.asyncio
async def test_the_tail_reads_this_nodes_commits_at_once_only_for_readers_not_of_memory(
    live: LiveStore, feed: Feed
) -> None:
    """The node wakes the tail after its own commits only while some reader needs it: one of
    the whole log, or of a turn memory does not hold; a reader of memory does not."""
    held = await append(live, "t1", 1, NO_STREAM)
    feed.remember(held.events)
    assert not tails(feed)
    async with feed.subscribe(Scope(turn_id="t1"), START) as first:
        assert tails(feed)  # until it takes memory's events
        first.start_after(feed.recent("t1", START) or [])
        assert not tails(feed)
        async with feed.subscribe(Scope(turn_id="t1"), START) as second:
            second.start_after(feed.recent("t1", START) or [])
            async with feed.subscribe(Scope(agent_id="ag"), None):
                assert tails(feed)
            assert not tails(feed)
            second.leave_memory()
            assert tails(feed)
        assert not tails(feed)
    assert not tails(feed) and feed.subscribers == 0


@pytest.mark.asyncio
async def test_memory_is_bounded_by_the_size_of_what_it_holds_too(
    live: LiveStore, feed: Feed
) -> None:
    """A few turns with large events (a 1 MB input, a long tool output) fill the bound on
    bytes long before the one on events: the oldest go, and what is held stays under it."""
    big = "x" * (1 << 20)
    turns = _RECENT_BYTES // len(big) + 2
    for n in range(turns):
        meta = Metadata(agent_id="ag", session_key="s", turn_id=f"big{n}")
        done = await live.store.aappend(
            f"turn-big{n}", [NewEvent(event=TurnStart(source="api", input=big), metadata=meta)]
        )
        feed.remember(done.events)
    held = [n for n in range(turns) if feed.recent(f"big{n}", START) is not None]
    assert held and held[-1] == turns - 1
    assert len(held) * len(big) <= _RECENT_BYTES < (len(held) + 1) * (len(big) + 100)
    small = await append(live, "small", 3, NO_STREAM)  # ordinary turns are still held after
    feed.remember(small.events)
    assert feed.recent("small", START) == small.events
