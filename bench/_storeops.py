"""The event store's own operations as bench/eventstore.py measures them: appends one at a time
(latency), from many writer threads (group-commit throughput), in batches (seeding), and
catch-up reads of the log, sync, async and its SQL alone."""

from __future__ import annotations

from _report import pct, perf

# isort: split
import threading
import time
import uuid
from dataclasses import dataclass

import msgspec

from eventstore import NO_STREAM, START, EventStore, Metadata, NewEvent
from eventstore._sql import load
from eventstore.catalogue import ModelChunk

TEXT = "The quick brown fox jumps over the lazy dog. " * 3 + "Pack my box with five dozen."
TYPE = ModelChunk.TYPE
# The same JSON the store writes for the event's data, built without Dispach code.
PAYLOAD = msgspec.json.encode({"delta": TEXT, "kind": "text"}).decode()
AGENT = "bench"
SESSION = "bench-session"
SEED_BATCH = 100
PAGE = 1000


def new_event(turn: str) -> NewEvent:
    return NewEvent(
        event=ModelChunk(delta=TEXT),
        metadata=Metadata(agent_id=AGENT, session_key=SESSION, turn_id=turn),
    )


def fresh_stream() -> tuple[str, str]:
    turn = uuid.uuid4().hex
    return f"turn-{turn}", turn


def append_latency(store: EventStore, n: int, *, one_stream: bool) -> list[float]:
    latencies = []
    stream, turn = fresh_stream()
    expected = NO_STREAM
    for _ in range(n):
        if not one_stream:
            stream, turn = fresh_stream()
        events = [new_event(turn)]
        t0 = perf()
        result = store.submit(
            stream, events, expected if one_stream else NO_STREAM, blocking=True
        ).result()
        latencies.append(perf() - t0)
        expected = result.version
    return latencies


@dataclass(frozen=True)
class Throughput:
    writers: int
    appends: int
    seconds: float
    p50: float
    p99: float
    commands_per_batch: float

    @property
    def rate(self) -> float:
        return self.appends / self.seconds


def throughput(store: EventStore, writers: int, seconds: float, warmup: float) -> Throughput:
    """``writers`` threads, each appending one event at a time to its own stream (exact
    expected version, like a session actor), through the shared group-commit writer."""
    stop = threading.Event()
    barrier = threading.Barrier(writers + 1)
    done: list[list[tuple[float, float]]] = [[] for _ in range(writers)]
    failures: list[BaseException] = []

    def writer(k: int) -> None:
        stream, turn = fresh_stream()
        expected = NO_STREAM
        mine = done[k]
        barrier.wait()
        try:
            while not stop.is_set():
                events = [new_event(turn)]
                t0 = perf()
                expected = store.submit(stream, events, expected, blocking=True).result().version
                t1 = perf()
                mine.append((t1, t1 - t0))
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=writer, args=(k,), daemon=True) for k in range(writers)]
    for t in threads:
        t.start()
    barrier.wait()
    time.sleep(warmup)
    w = store._writer
    batches0, commands0 = w.batches, w.commands
    window_start = perf()
    time.sleep(seconds)
    window_end = perf()
    batches1, commands1 = w.batches, w.commands
    stop.set()
    for t in threads:
        t.join(30)
    if failures:
        raise failures[0]
    inside = [lat for mine in done for (at, lat) in mine if window_start <= at < window_end]
    return Throughput(
        writers,
        len(inside),
        window_end - window_start,
        pct(inside, 50),
        pct(inside, 99),
        (commands1 - commands0) / max(1, batches1 - batches0),
    )


def seed(store: EventStore, total: int) -> tuple[int, float]:
    """Appends of SEED_BATCH events each, one caller, each to a new stream."""
    appends = []
    for _ in range(total // SEED_BATCH):
        stream, turn = fresh_stream()
        appends.append((stream, [new_event(turn) for _ in range(SEED_BATCH)]))
    start = perf()
    for stream, events in appends:
        store.submit(stream, events, NO_STREAM, blocking=True).result()
    return len(appends) * SEED_BATCH, perf() - start


def read_sync(store: EventStore) -> tuple[int, float]:
    n, checkpoint = 0, START
    start = perf()
    while page := store.read_all(checkpoint, PAGE):
        n += len(page)
        checkpoint = page[-1].checkpoint
    return n, perf() - start


async def read_async(store: EventStore) -> tuple[int, float]:
    n, checkpoint = 0, START
    start = perf()
    while page := await store.aread_all(checkpoint, PAGE):
        n += len(page)
        checkpoint = page[-1].checkpoint
    return n, perf() - start


def read_sql_only(store: EventStore) -> tuple[int, float]:
    """The store's read_all query and fetch, without decoding rows: where the read time goes."""
    query = load("read_all").encode()
    n, txid, position = 0, 0, 0
    start = perf()
    while True:
        with store.pool.connection() as conn:
            params = {"txid": txid, "position": position, "limit": PAGE}
            rows = conn.execute(query, params).fetchall()
        if not rows:
            break
        n += len(rows)
        txid, position = int(rows[-1][3]), rows[-1][2]
    return n, perf() - start


def read_plan(store: EventStore) -> str:
    with store.pool.connection() as conn:
        rows = conn.execute(
            b"EXPLAIN " + load("read_all").encode(), {"txid": 0, "position": 0, "limit": PAGE}
        ).fetchall()
    return " / ".join(str(r[0]).strip() for r in rows[:3])
