"""Benchmark of the event store against raw psycopg, in one run, on one database.

    .venv/bin/python bench/eventstore.py [--quick] [--keep]

Uses DATABASE_URL / NATS_URL when set, else starts the embedded Postgres and NATS in a fresh
temporary directory (removed afterwards). Every run works in its own schema ``bench_<hex>``.

Baselines (raw psycopg, no Dispach code, a scratch table of uuid, text and jsonb):
  - single-row INSERT + COMMIT from one connection;
  - ``executemany`` of 100 rows per transaction;
  - a keyset read of the log's rows in pages of 1000 (tuples, nothing decoded);
  - commit, NATS hint, subscriber wakes and reads the new row.
The store's figures: append latency, group-commit throughput with 1/8/64 writer threads,
batched appends, catch-up reads (sync and async), and commit -> subscriber latency through
the NATS commit hints. Goals: issue "foundation" (64 writers >= 3x the raw commit rate, reads
>= 80k events/s, subscriber p50 <= 2 ms and p99 <= 5 ms) and the "ambitious goal" column of
eventstore-notes "Goal numbers" (append p50 <= 0.5 ms, p99 <= 2 ms; batched >= 15k events/s).
"""

from __future__ import annotations

# First: it takes this directory off the front of the import path (see its docstring).
from _report import (
    INSERT,
    Goal,
    Line,
    drop_schemas,
    line,
    machine_facts,
    ms,
    pct,
    perf,
    print_table,
    rate,
    raw_connect,
    raw_setup,
    raw_single,
    run_loop,
    section,
    servers,
)

# isort: split
from _storeops import (
    PAGE,
    PAYLOAD,
    SEED_BATCH,
    TYPE,
    Throughput,
    append_latency,
    fresh_stream,
    new_event,
    read_async,
    read_plan,
    read_sql_only,
    read_sync,
    seed,
    throughput,
)

# isort: split
import argparse
import asyncio
import contextlib
import logging
import queue
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import psycopg
import structlog

from eventstore import NO_STREAM, AppendResult, EventStore, NatsHints, RecordedEvent


@dataclass(frozen=True)
class Plan:
    raw_seconds: float
    latency_appends: int
    throughput_seconds: float
    warmup_seconds: float
    seed_events: int
    subscriber_samples: int


FULL = Plan(5.0, 3000, 8.0, 1.0, 100_000, 3000)
QUICK = Plan(0.5, 200, 1.0, 0.2, 5_000, 150)
WRITERS = (1, 8, 64)


# --- raw psycopg baselines -----------------------------------------------------------------------


def raw_batch(url: str, schema: str, seconds: float) -> float:
    """``executemany`` of SEED_BATCH rows per transaction, sequential, from one connection."""
    with raw_connect(url, schema) as conn, conn.cursor() as cur:
        batches: list[float] = []
        start = perf()
        end = start + seconds
        while (t0 := perf()) < end:
            rows = [(uuid.uuid4(), TYPE, PAYLOAD) for _ in range(SEED_BATCH)]
            cur.executemany(INSERT, rows)
            conn.commit()
            batches.append(perf() - t0)
        batch_rate = len(batches) * SEED_BATCH / (perf() - start)
    print(
        f"raw executemany {SEED_BATCH}/txn: {rate(batch_rate)} events "
        f"({len(batches)} txns), p50 {ms(pct(batches, 50))} per txn"
    )
    return batch_rate


def raw_read(url: str, schema: str) -> tuple[int, float]:
    """Keyset pages of the events table by global_position, tuples left undecoded."""
    query = (
        b"SELECT stream_id, stream_version, global_position, transaction_id::text, event_id,"
        b" type, data::text, metadata::text, recorded_at FROM events"
        b" WHERE global_position > %s ORDER BY global_position LIMIT %s"
    )
    with raw_connect(url, schema) as conn:
        n, last = 0, 0
        start = perf()
        while rows := conn.execute(query, (last, PAGE)).fetchall():
            n += len(rows)
            last = rows[-1][2]
            conn.commit()
        return n, perf() - start


@dataclass(frozen=True)
class Delivery:
    submit_to_yield: list[float]
    commit_to_yield: list[float]


async def subscriber_latency(store: EventStore, samples: int, poll: float) -> Delivery:
    """One event at a time from a thread; the subscriber yields it through the NATS hints."""
    got: queue.Queue[tuple[uuid.UUID, float]] = queue.Queue()
    after = await asyncio.to_thread(store.head)

    async def consume() -> None:
        async for event in store.subscribe(after=after):
            got.put_nowait((event.event_id, perf()))

    task = asyncio.create_task(consume())
    submit: list[float] = []
    commit: list[float] = []
    late: list[tuple[datetime, float]] = []

    def produce() -> None:
        stream, turn = fresh_stream()
        expected = NO_STREAM
        for _ in range(samples):
            events = [new_event(turn)]
            t0 = perf()
            result: AppendResult = store.submit(stream, events, expected, blocking=True).result()
            t1 = perf()
            expected = result.version
            while True:
                event_id, seen = got.get(timeout=10)
                if event_id == events[0].event_id:
                    break
            submit.append(seen - t0)
            commit.append(seen - t1)
            if seen - t0 >= poll / 2:
                late.append((datetime.now(UTC), seen - t0))

    try:
        await asyncio.to_thread(produce)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    print(
        f"store: submit->yield p50 {ms(pct(submit, 50))} p99 {ms(pct(submit, 99))} "
        f"max {ms(max(submit))}; commit->yield p50 {ms(pct(commit, 50))} "
        f"p99 {ms(pct(commit, 99))}"
    )
    print(
        f"{len(late)} of {samples} took >= {poll / 2 * 1000:.0f} ms (the reader woke by its "
        f"{poll * 1000:.0f} ms poll, not by the hint)"
    )
    if late:
        for at, seconds in late:
            print(f"  slow sample at {_utc(at)}: {ms(seconds)}")
        print(f"  autovacuum of the events table: {await asyncio.to_thread(autovacuum, store)}")
    return Delivery(submit, commit)


def autovacuum(store: EventStore) -> str:
    """When autovacuum last analyzed / vacuumed the events table (an ANALYZE holds a
    transaction id, which holds back every checkpointed reader until it ends)."""
    with store.pool.connection() as conn:
        row = conn.execute(
            "SELECT last_autoanalyze, last_autovacuum, autoanalyze_count, autovacuum_count"
            " FROM pg_stat_user_tables WHERE relid = 'events'::regclass"
        ).fetchone()
    if row is None:
        return "no statistics"
    analyzed, vacuumed, n_analyze, n_vacuum = row
    return (
        f"last autoanalyze {_utc(analyzed)} ({n_analyze} in all), last autovacuum "
        f"{_utc(vacuumed)} ({n_vacuum} in all)"
    )


def _utc(at: datetime | None) -> str:
    return "never" if at is None else f"{at.astimezone(UTC):%H:%M:%S.%f} UTC"


async def raw_subscriber_latency(
    url: str, schema: str, nc: nats.aio.client.Client, samples: int
) -> Delivery:
    """The same path without the store: INSERT+COMMIT, a NATS publish from the committing thread,
    a subscriber woken by it reading the new rows over its own async connection."""
    loop = asyncio.get_running_loop()
    subject = f"bench.raw.{secrets.token_hex(4)}"
    wake = asyncio.Event()

    async def on_hint(msg: Any) -> None:
        wake.set()

    sub = await nc.subscribe(subject, cb=on_hint)
    aconn = await psycopg.AsyncConnection.connect(
        url, autocommit=True, options=f"-c search_path={schema}"
    )
    cur = await aconn.execute("SELECT coalesce(max(seq), 0) FROM scratch")
    row = await cur.fetchone()
    last = int(row[0]) if row else 0
    got: queue.Queue[tuple[uuid.UUID, float]] = queue.Queue()
    query = b"SELECT seq, id, type, data::text FROM scratch WHERE seq > %s ORDER BY seq"

    async def consume() -> None:
        nonlocal last
        while True:
            await wake.wait()
            wake.clear()
            cur = await aconn.execute(query, (last,))
            for seq, row_id, _type, _data in await cur.fetchall():
                last = seq
                got.put_nowait((row_id, perf()))

    task = asyncio.create_task(consume())
    submit: list[float] = []
    commit: list[float] = []

    def produce() -> None:
        with raw_connect(url, schema) as conn:
            for _ in range(samples):
                row_id = uuid.uuid4()
                t0 = perf()
                conn.execute(INSERT, (row_id, TYPE, PAYLOAD))
                conn.commit()
                t1 = perf()
                asyncio.run_coroutine_threadsafe(nc.publish(subject, b"1"), loop)
                while True:
                    seen_id, seen = got.get(timeout=10)
                    if seen_id == row_id:
                        break
                submit.append(seen - t0)
                commit.append(seen - t1)

    try:
        await asyncio.to_thread(produce)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sub.unsubscribe()
        await aconn.close()
    print(
        f"raw: insert->read p50 {ms(pct(submit, 50))} p99 {ms(pct(submit, 99))}; "
        f"commit->read p50 {ms(pct(commit, 50))} p99 {ms(pct(commit, 99))}"
    )
    return Delivery(submit, commit)


# --- the run -------------------------------------------------------------------------------------


async def bench(url: str, nats_url: str, plan: Plan, data_dir: Path | None, keep: bool) -> None:
    loop = asyncio.get_running_loop()
    schema = f"bench_{secrets.token_hex(4)}"
    nc = await nats.connect(nats_url)
    machine_facts(url, str(nc.connected_server_version), data_dir)
    print(f"schema: {schema}  mode: {'quick' if plan is QUICK else 'full'}")

    nats_hints: NatsHints | None = None

    def on_commit(events: Sequence[RecordedEvent]) -> None:
        assert nats_hints is not None
        asyncio.run_coroutine_threadsafe(nats_hints.publish(events), loop)

    store = EventStore(url, schema=schema, on_commit=on_commit)
    nats_hints = NatsHints(nc, store.hints)
    await nats_hints.start()
    await store.aopen()
    lines: list[Line] = []
    try:
        await asyncio.to_thread(raw_setup, url, schema)

        section("baseline: raw psycopg writes")
        raw = await asyncio.to_thread(
            raw_single, url, schema, plan.raw_seconds, "before 1", PAYLOAD
        )
        raw_batch_rate = await asyncio.to_thread(raw_batch, url, schema, plan.raw_seconds)

        section("1. append latency (one event per append, sequential)")
        distinct = await asyncio.to_thread(
            append_latency, store, plan.latency_appends, one_stream=False
        )
        single = await asyncio.to_thread(
            append_latency, store, plan.latency_appends, one_stream=True
        )
        for name, lat in (("distinct streams", distinct), ("one stream, exact", single)):
            print(
                f"{name}: p50 {ms(pct(lat, 50))} p99 {ms(pct(lat, 99))} "
                f"mean {ms(sum(lat) / len(lat))} ({len(lat)} appends)"
            )
        p50_goal = Goal("<= 0.50 ms", lambda o, b: o <= 0.0005)
        p99_goal = Goal("<= 2.00 ms", lambda o, b: o <= 0.002)
        lines += [
            line("append latency p50, distinct streams", pct(distinct, 50), raw.p50, ms,
                 p50_goal),
            line("append latency p99, distinct streams", pct(distinct, 99), raw.p99, ms,
                 p99_goal),
            line("append latency p50, one stream (exact version)", pct(single, 50),
                 raw.p50, ms, p50_goal),
            line("append latency p99, one stream (exact version)", pct(single, 99),
                 raw.p99, ms, p99_goal),
        ]  # fmt: skip

        section("2. append throughput (writer threads, one event per append)")
        tps: list[Throughput] = []
        for writers in WRITERS:
            t = await asyncio.to_thread(
                throughput, store, writers, plan.throughput_seconds, plan.warmup_seconds
            )
            tps.append(t)
            print(
                f"{writers:>2} writers: {rate(t.rate)} events = {rate(t.rate)} appends "
                f"({t.appends} in {t.seconds:.1f} s), latency p50 {ms(t.p50)} p99 {ms(t.p99)}, "
                f"{t.commands_per_batch:.1f} appends per commit, "
                f"{t.rate / raw.rate:.2f}x the raw single-row commits measured before"
            )

        section("baseline again, right after: the machine is shared")
        raw_end = await asyncio.to_thread(
            raw_single, url, schema, plan.raw_seconds, "after 2", PAYLOAD
        )
        base = (raw.rate + raw_end.rate) / 2
        print(f"throughput baseline: mean of before and after = {rate(base)}")
        for t in tps:
            goal = Goal(">= 3x baseline", lambda o, b: o >= 3 * b) if t.writers == 64 else None
            lines.append(
                line(f"append throughput, {t.writers} writer(s), events/s", t.rate, base, rate,
                     goal)
            )  # fmt: skip

        section(f"3a. batched appends ({SEED_BATCH} events per append, one caller)")
        seeded, seconds = await asyncio.to_thread(seed, store, plan.seed_events)
        batch_rate = seeded / seconds
        print(f"{seeded} events in {seconds:.2f} s: {rate(batch_rate)} events")
        lines.append(
            line(f"batched append, {SEED_BATCH} events/append, events/s", batch_rate,
                 raw_batch_rate, rate, Goal(">= 15,000/s", lambda o, b: o >= 15_000))
        )  # fmt: skip

        section(f"3b. catch-up reads (pages of {PAGE})")
        print(f"plan: {await asyncio.to_thread(read_plan, store)}")
        n_raw, s_raw = await asyncio.to_thread(raw_read, url, schema)
        print(
            f"raw keyset read, undecoded: {n_raw} events in {s_raw:.2f} s = {rate(n_raw / s_raw)}"
        )
        n_sql, s_sql = await asyncio.to_thread(read_sql_only, store)
        print(
            f"store's read_all SQL, undecoded: {n_sql} events in {s_sql:.2f} s "
            f"= {rate(n_sql / s_sql)}"
        )
        n_sync, s_sync = await asyncio.to_thread(read_sync, store)
        print(f"read_all: {n_sync} events in {s_sync:.2f} s = {rate(n_sync / s_sync)}")
        n_async, s_async = await read_async(store)
        print(f"aread_all: {n_async} events in {s_async:.2f} s = {rate(n_async / s_async)}")
        read_goal = Goal(">= 80,000/s", lambda o, b: o >= 80_000)
        lines += [
            line(f"catch-up read_all ({n_sync:,} events), events/s", n_sync / s_sync,
                 n_raw / s_raw, rate, read_goal),
            line(f"catch-up aread_all ({n_async:,} events), events/s", n_async / s_async,
                 n_raw / s_raw, rate, read_goal),
        ]  # fmt: skip

        section("4. commit -> subscriber latency (NATS hints)")
        raw_delivery = await raw_subscriber_latency(url, schema, nc, plan.subscriber_samples)
        delivery = await subscriber_latency(store, plan.subscriber_samples, store.poll_interval)
        s, c = delivery.submit_to_yield, delivery.commit_to_yield
        rs, rc = raw_delivery.submit_to_yield, raw_delivery.commit_to_yield
        lines += [
            line("submit -> subscriber yield p50", pct(s, 50), pct(rs, 50), ms,
                 Goal("<= 2.00 ms", lambda o, b: o <= 0.002)),
            line("submit -> subscriber yield p99", pct(s, 99), pct(rs, 99), ms,
                 Goal("<= 5.00 ms", lambda o, b: o <= 0.005)),
            line("append return -> subscriber yield p50", pct(c, 50), pct(rc, 50), ms),
            line("append return -> subscriber yield p99", pct(c, 99), pct(rc, 99), ms),
        ]  # fmt: skip
    finally:
        await store.aclose()
        await nats_hints.stop()
        await nc.close()
        if not keep:
            await asyncio.to_thread(drop_schemas, url, [schema])

    section("results (ratio = ours / baseline)")
    print(
        "baselines: latency rows = raw single-row INSERT+COMMIT (before 1); throughput rows = its"
        " rate, mean of before 1 and after 2;\n  batched row = raw"
        f" executemany {SEED_BATCH}/txn;\n  read rows = raw keyset read, undecoded; subscriber"
        " rows = raw INSERT+COMMIT -> NATS publish -> woken reader SELECTs the row"
    )
    print_table(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small counts, a smoke run")
    parser.add_argument("--keep", action="store_true", help="keep the bench schema afterwards")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    started = perf()

    with servers() as found:
        run_loop(bench(found.database_url, found.nats_url, plan, found.data_dir, args.keep))
    print(f"\ntotal time {perf() - started:.1f} s")


if __name__ == "__main__":
    main()
