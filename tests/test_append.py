"""Appending: optimistic concurrency, idempotent ids, the append-only table, group commit."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from eventstore import (
    ANY,
    INLINE,
    NO_STREAM,
    EventIdReused,
    EventStore,
    InvalidAppend,
    Metadata,
    NewEvent,
    RecordedEvent,
    StoreError,
    WrongExpectedVersion,
)
from eventstore.catalogue import ModelChunk, TurnStart
from tests.conftest import ConnectFactory, Servers
from tests.storeops import append


def chunk(text: str, **ids: str) -> NewEvent:
    return NewEvent(event=ModelChunk(delta=text), metadata=Metadata(**ids))


def count(connect: ConnectFactory, stream: str | None = None) -> int:
    with connect() as conn:
        if stream is None:
            row = conn.execute("SELECT count(*) FROM events").fetchone()
        else:
            row = conn.execute(
                "SELECT count(*) FROM events WHERE stream_id = %s", [stream]
            ).fetchone()
    assert row is not None
    return int(row[0])


def test_versions_start_at_zero_and_follow_the_expected_version(store: EventStore) -> None:
    first = append(store, "turn-a", [chunk("a"), chunk("b")], NO_STREAM)
    assert [e.version for e in first.events] == [0, 1]
    second = append(store, "turn-a", [chunk("c")], 1)
    assert second.version == 2
    assert store.stream_version("turn-a") == 2
    assert store.stream_version("turn-none") == NO_STREAM
    assert [e.data for e in store.read_stream("turn-a")] == [
        ModelChunk(delta="a"), ModelChunk(delta="b"), ModelChunk(delta="c")
    ]  # fmt: skip


def test_a_stale_expected_version_is_refused_with_code_and_hint(store: EventStore) -> None:
    append(store, "turn-b", [chunk("a")], NO_STREAM)
    with pytest.raises(WrongExpectedVersion) as caught:
        append(store, "turn-b", [chunk("b")], NO_STREAM)
    error = caught.value
    assert (error.code, error.stream, error.expected, error.actual) == (
        "wrong_expected_version", "turn-b", -1, 0
    )  # fmt: skip
    assert "reload" in error.hint
    with pytest.raises(WrongExpectedVersion):
        append(store, "turn-b", [chunk("b")], 5)  # ahead of the stream: would leave a gap


@pytest.mark.parametrize("projected", [False, True], ids=["plain", "with-inline-projection"])
def test_two_stores_racing_on_one_stream_one_wins_and_nothing_is_half_written(
    servers: Servers, schema: str, store: EventStore, connect: ConnectFactory, projected: bool
) -> None:
    other = EventStore(servers.database_url, schema=schema, inline=INLINE)  # a second node
    other.open()
    try:
        for round_ in range(30):
            stream = f"session-race-{round_}"
            append(store, stream, [chunk("seed")], NO_STREAM)
            barrier = threading.Barrier(2)

            def attempt(
                s: EventStore, who: str, barrier: threading.Barrier = barrier, stream: str = stream
            ) -> str:
                barrier.wait()
                events = [chunk(f"{who}-1"), chunk(f"{who}-2"), chunk(f"{who}-3")]
                if projected:  # the turns projection runs in the same transaction
                    meta = Metadata(agent_id="a", session_key="k", turn_id=stream)
                    events[0] = NewEvent(event=TurnStart(source=who), metadata=meta)
                try:
                    append(s, stream, events, 0)
                except WrongExpectedVersion:
                    return "lost"
                return "won"

            with ThreadPoolExecutor(2) as pool:
                outcomes = sorted(pool.map(attempt, [store, other], ["x", "y"]))
            assert outcomes == ["lost", "won"]
            events = store.read_stream(stream)
            assert [e.version for e in events] == [0, 1, 2, 3]
            writers = {e.data.delta.split("-")[0] for e in events[2:]}  # type: ignore[union-attr]
            assert len(writers) == 1  # all three events of the winner, none of the loser
            if projected:
                winner = events[1].data.source  # type: ignore[union-attr]
                with connect() as conn:
                    row = conn.execute(
                        "SELECT source FROM turns WHERE turn_id = %s", [stream]
                    ).fetchone()
                assert row == (winner,)
    finally:
        other.close()


def test_racing_commands_in_one_batch_are_decided_one_after_the_other(store: EventStore) -> None:
    futures = [store.submit("turn-c", [chunk(str(i))], NO_STREAM) for i in range(20)]
    won = [f for f in futures if f.exception() is None]
    lost = [f.exception() for f in futures if f.exception() is not None]
    assert len(won) == 1
    assert all(isinstance(e, WrongExpectedVersion) for e in lost)
    assert store.stream_version("turn-c") == 0


def test_a_streams_queued_appends_that_continue_each_other_commit_together(
    store: EventStore,
) -> None:
    # A turn submits its appends without waiting, each expecting the version the one before
    # leaves: queued behind a commit, they are chained into one command (one commit), and each
    # caller still gets its own events and versions.
    futures = [store.submit("turn-chain", [chunk(f"{i}a"), chunk(f"{i}b")], 2 * i - 1)
               for i in range(60)]  # fmt: skip
    results = [f.result(10) for f in futures]
    assert [[e.version for e in r.events] for r in results] == [[2 * i, 2 * i + 1]
                                                                for i in range(60)]  # fmt: skip
    assert [r.events[0].data.delta for r in results] == [f"{i}a" for i in range(60)]  # type: ignore[union-attr]
    assert len({r.events[0].txid for r in results}) < 60  # some shared a commit


def test_a_chain_fails_as_a_whole_and_an_unchained_append_alone(store: EventStore) -> None:
    append(store, "turn-chain2", [chunk("seed")], NO_STREAM)
    # The first expects a stale version: the one chained on it cannot commit either.
    stale = store.submit("turn-chain2", [chunk("x")], 5)
    after_stale = store.submit("turn-chain2", [chunk("y")], 6)
    assert isinstance(stale.exception(10), WrongExpectedVersion)
    assert isinstance(after_stale.exception(10), WrongExpectedVersion)
    # A second append that does not continue the first waits for it and is decided alone.
    first = store.submit("turn-chain2", [chunk("z")], 0)
    racing = store.submit("turn-chain2", [chunk("w")], 0)
    assert first.result(10).version == 1
    assert isinstance(racing.exception(10), WrongExpectedVersion)
    assert store.stream_version("turn-chain2") == 1


def test_reappending_the_same_ids_returns_the_original_positions_and_writes_nothing(
    store: EventStore, connect: ConnectFactory
) -> None:
    events = [chunk("a"), chunk("b")]
    original = append(store, "turn-d", events, NO_STREAM)
    append(store, "turn-d", [chunk("c")], ANY)
    before = count(connect)
    again = append(store, "turn-d", events, NO_STREAM)  # the stale version does not matter
    assert again.duplicate
    assert [(e.position, e.version, e.event_id) for e in again.events] == [
        (e.position, e.version, e.event_id) for e in original.events
    ]
    assert count(connect) == before


def test_an_event_id_reused_for_another_event_is_refused(store: EventStore) -> None:
    event = chunk("a")
    append(store, "turn-e", [event], NO_STREAM)
    with pytest.raises(EventIdReused):
        append(store, "turn-f", [event], NO_STREAM)  # same id, another stream
    with pytest.raises(EventIdReused):
        append(store, "turn-e", [event, chunk("b")], ANY)  # a retry with extra events


def test_events_can_be_neither_updated_nor_deleted_nor_truncated(
    store: EventStore, connect: ConnectFactory
) -> None:
    append(store, "turn-g", [chunk("a")], NO_STREAM)
    for statement in (
        "UPDATE events SET type = 'x'",
        "DELETE FROM events",
        "DELETE FROM events WHERE false",
        "TRUNCATE events",
    ):
        with connect() as conn, pytest.raises(psycopg.errors.RestrictViolation) as caught:
            conn.execute(statement.encode())
        assert "append-only" in str(caught.value)
    assert count(connect, "turn-g") == 1


def test_invalid_appends_are_refused_before_reaching_the_writer(store: EventStore) -> None:
    with pytest.raises(InvalidAppend):
        append(store, "turn-h", [])
    with pytest.raises(InvalidAppend):
        append(store, "turn-h", [chunk("a")], -7)


def test_one_conflicting_command_fails_alone_in_its_batch(store: EventStore) -> None:
    append(store, "turn-i", [chunk("seed")], NO_STREAM)
    good = [store.submit(f"turn-ok-{i}", [chunk("a")], NO_STREAM) for i in range(50)]
    bad = store.submit("turn-i", [chunk("b")], NO_STREAM)
    assert all(f.result(10).version == 0 for f in good)
    assert isinstance(bad.exception(10), WrongExpectedVersion)


def test_a_command_postgres_refuses_fails_alone(store: EventStore) -> None:
    # A NUL character cannot be stored in jsonb: Postgres refuses it, the writer isolates it.
    good = [store.submit(f"turn-n-{i}", [chunk("fine")], NO_STREAM) for i in range(10)]
    bad = store.submit("turn-nul", [chunk("nul\u0000")], NO_STREAM)
    error = bad.exception(10)
    assert error is not None and getattr(error, "code", None) == "invalid_value"
    assert all(f.result(10).version == 0 for f in good)
    assert append(store, "turn-after", [chunk("still writing")]).version == 0


def test_concurrent_appends_share_transactions(store: EventStore) -> None:
    with ThreadPoolExecutor(32) as pool:
        results = list(
            pool.map(lambda i: append(store, f"turn-gc-{i}", [chunk("x")], NO_STREAM), range(2000))
        )
    assert len({r.events[0].position for r in results}) == 2000
    txids = {r.events[0].txid for r in results}
    assert len(txids) < 2000  # some appends shared a transaction (group commit)


def test_metadata_and_ids_round_trip(store: EventStore) -> None:
    event_id = uuid.uuid4()
    meta = Metadata(agent_id="ag", session_key="api:default", turn_id="t1", step_id="s1")
    append(
        store,
        "turn-t1",
        [NewEvent(event=TurnStart(source="api", input="hi"), metadata=meta, event_id=event_id)],
    )
    [stored] = store.read_stream("turn-t1")
    assert (stored.event_id, stored.metadata, stored.type) == (event_id, meta, "turn.start")
    assert stored.data == TurnStart(source="api", input="hi")


class _Exploding:
    """A projection with a bug: it raises on one particular event."""

    name = "exploding"
    tables: tuple[str, ...] = ()
    types = frozenset({ModelChunk.TYPE})

    def statements(self, event: RecordedEvent) -> list[tuple[str, list[object]]]:
        if isinstance(event.data, ModelChunk) and event.data.delta == "boom":
            raise KeyError("boom")
        return []


def test_a_bug_in_a_projection_fails_its_command_and_the_writer_lives_on(
    servers: Servers, schema: str, store: EventStore
) -> None:
    buggy = EventStore(servers.database_url, schema=schema, inline=[_Exploding()])
    buggy.open()
    try:
        good = [buggy.submit(f"turn-p{i}", [chunk("fine")], NO_STREAM) for i in range(20)]
        bad = buggy.submit("turn-boom", [chunk("boom")], NO_STREAM)
        error = bad.exception(10)
        assert isinstance(error, StoreError)
        assert "KeyError" in error.message
        assert all(f.result(10).version == 0 for f in good)
        assert buggy.stream_version("turn-boom") == NO_STREAM  # nothing half-written
        assert append(buggy, "turn-later", [chunk("ok")]).version == 0
    finally:
        buggy.close()
