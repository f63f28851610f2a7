"""Reading the whole log in checkpoint order, while writers commit out of order."""

from __future__ import annotations

import os
import random
import threading
import time
import uuid

import msgspec
import psycopg
import pytest

from eventstore import START, Checkpoint, EventStore, InvalidCursor, NewEvent
from eventstore.catalogue import ModelChunk
from tests.conftest import ConnectFactory
from tests.storeops import append

INSERT = """INSERT INTO events (stream_id, stream_version, event_id, type, data, metadata)
            VALUES (%s, %s, %s, 'model.chunk', %s, '{}')"""


def test_a_tailing_reader_sees_every_event_once_in_checkpoint_order(
    store: EventStore, connect: ConnectFactory
) -> None:
    seed = int(os.environ.get("DISPACH_SEED") or random.randrange(2**32))
    print(f"DISPACH_SEED={seed}")
    rng = random.Random(seed)
    committed: set[uuid.UUID] = set()
    rolled_back: set[uuid.UUID] = set()
    lock = threading.Lock()
    writers_done = threading.Event()

    def raw_writer(n: int, wrng: random.Random) -> None:
        # Transactions that take their positions early and commit late (or never), interleaved
        # with short ones: the case a bare global_position checkpoint gets wrong.
        conn = connect()
        version = 0
        for _ in range(25):
            ids = [uuid.uuid4() for _ in range(wrng.randint(1, 4))]
            for i, event_id in enumerate(ids):
                data = msgspec.json.encode(ModelChunk(delta=f"{n}")).decode()
                conn.execute(INSERT, [f"raw-{n}", version + i, event_id, data])
                if wrng.random() < 0.5:
                    time.sleep(wrng.random() * 0.01)
            if wrng.random() < 0.1:
                conn.rollback()
                with lock:
                    rolled_back.update(ids)
                continue
            if wrng.random() < 0.3:
                time.sleep(wrng.random() * 0.03)  # a long transaction
            conn.commit()
            version += len(ids)
            with lock:
                committed.update(ids)

    def store_writer(n: int, wrng: random.Random) -> None:
        for i in range(40):
            events = [NewEvent(event=ModelChunk(delta="s")) for _ in range(wrng.randint(1, 3))]
            result = append(store, f"turn-s{n}-{i}", events)
            with lock:
                committed.update(e.event_id for e in result.events)

    seen: list[uuid.UUID] = []
    checkpoints: list[Checkpoint] = []

    def reader() -> None:
        checkpoint = START
        idle_after_done = 0
        while idle_after_done < 3:
            page = store.read_all(checkpoint, limit=rng.randint(1, 50))
            for event in page:
                seen.append(event.event_id)
                checkpoints.append(event.checkpoint)
                checkpoint = event.checkpoint
            if not page:
                idle_after_done += writers_done.is_set()
                time.sleep(0.002)

    threads = [
        threading.Thread(target=raw_writer, args=(n, random.Random(rng.random()))) for n in range(6)
    ] + [
        threading.Thread(target=store_writer, args=(n, random.Random(rng.random())))
        for n in range(3)
    ]
    tail = threading.Thread(target=reader)
    tail.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writers_done.set()
    tail.join(60)

    context = f"(DISPACH_SEED={seed})"
    assert len(seen) == len(set(seen)), f"an event was read twice {context}"
    assert set(seen) == committed, f"missed {len(committed - set(seen))} events {context}"
    assert not set(seen) & rolled_back
    assert checkpoints == sorted(checkpoints), f"checkpoints went backwards {context}"


def test_a_long_append_holds_readers_back_instead_of_being_skipped(
    store: EventStore, connect: ConnectFactory
) -> None:
    slow = connect()
    slow_id = uuid.uuid4()
    data = msgspec.json.encode(ModelChunk(delta="slow")).decode()
    slow.execute(INSERT, ["raw-slow", 0, slow_id, data])  # takes its position first
    fast = append(store, "turn-fast", [NewEvent(event=ModelChunk(delta="fast"))])
    assert fast.events[0].position > 0  # appends do not wait for each other
    assert store.read_all() == []  # the fast event waits behind the open append
    slow.commit()
    ids = [e.event_id for e in store.read_all()]
    assert ids == [slow_id, fast.events[0].event_id]


def test_a_foreign_transaction_holding_an_xid_holds_no_reader_back(
    store: EventStore, connect: ConnectFactory
) -> None:
    # What froze every stream before migration 0012: an idle psql after a write.
    stray = connect()
    stray.execute("SELECT pg_current_xact_id()")
    appended = append(store, "turn-now", [NewEvent(event=ModelChunk(delta="now"))])
    assert [e.event_id for e in store.read_all()] == [appended.events[0].event_id]
    stray.rollback()


def test_an_append_after_another_write_of_its_transaction_is_refused(
    store: EventStore, connect: ConnectFactory
) -> None:
    conn = connect()
    conn.execute("SELECT pg_current_xact_id()")  # the transaction holds an id already
    data = msgspec.json.encode(ModelChunk(delta="late")).decode()
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as caught:
        conn.execute(INSERT, ["raw-late", 0, uuid.uuid4(), data])
    assert "first write of its transaction" in str(caught.value)
    conn.rollback()


def test_cursors_are_opaque_and_round_trip() -> None:
    checkpoint = Checkpoint(123456789, 42)
    assert Checkpoint.from_cursor(checkpoint.cursor()) == checkpoint
    for bad in ("", "not-a-cursor!", "AAAA"):
        with pytest.raises(InvalidCursor) as caught:
            Checkpoint.from_cursor(bad)
        assert caught.value.code == "invalid_cursor"


def test_head_is_the_newest_visible_checkpoint(store: EventStore) -> None:
    assert store.head() == START
    result = append(store, "turn-h", [NewEvent(event=ModelChunk(delta="x"))])
    assert store.head() == result.checkpoint
    assert store.read_all(store.head()) == []
