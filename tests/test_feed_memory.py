"""A turn's events held in memory as this node commits them (eventstore/feed.py, Feed.remember):
a reader of that turn starts from memory and its catch-up from Postgres goes on after it, with
no event lost or repeated; memory serves a turn only while it holds it whole."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from eventstore import NO_STREAM, START, AppendResult, RecordedEvent
from eventstore.feed import _RECENT_EVENTS, Feed, Scope
from tests.conftest import LiveStore
from tests.test_feed import batch, ids, running, take


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
